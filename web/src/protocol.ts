/**
 * What crosses the network, in the model's vocabulary (`model/document_protocol.py`): requests,
 * answers, and the draft slot key. The HTTP mapping is in `http.ts`.
 */
import type { Content, Schema } from "./kinds.js";

export interface SaveRequest {
  type: "save";
  docId: string;
  user: string;
  writerId: string;
  seq: number;
  baseVersion: number;
  content: Content;
  generation: number; // the local edit generation this snapshot reflects (client-side only)
}

export interface ReadRequest {
  type: "read";
  docId: string;
  user: string;
  readSeq: number;
  generation: number;
  baseVersion: number | null;
  purpose: "load" | "refresh" | "replace";
}

export interface CopyRequest {
  type: "copy";
  copyOf: string;
  user: string;
  writerId: string;
  seq: number;
  content: Content;
  generation: number;
}

export type Request = SaveRequest | ReadRequest | CopyRequest;

export interface Snapshot {
  id: string;
  kind: string;
  schema: Schema;
  version: number;
  content: Content;
}

export type Answer =
  | { type: "snapshot"; snapshot: Snapshot }
  | { type: "saved"; version: number; replayed: boolean }
  | { type: "created"; id: string; version: number; replayed: boolean }
  | { type: "conflict"; version: number; content: Content }
  | { type: "seqTaken"; writerId: string; seq: number; version: number; lastSeq: number }
  | { type: "rejected"; reason: string }
  | { type: "noAnswer"; reason: string };

/** The JSON a draft slot holds of a save in flight (`SaveRequest.to_json` in the model). */
export interface InflightJson {
  writerId: string;
  seq: number;
  baseVersion: number;
  content: Content;
  generation: number;
}

export function saveToJson(r: SaveRequest): InflightJson {
  return {
    writerId: r.writerId,
    seq: r.seq,
    baseVersion: r.baseVersion,
    content: { ...r.content },
    generation: r.generation,
  };
}

export function saveFromJson(docId: string, user: string, d: InflightJson): SaveRequest {
  return {
    type: "save",
    docId,
    user,
    writerId: d.writerId,
    seq: Number(d.seq),
    baseVersion: Number(d.baseVersion),
    content: { ...d.content },
    generation: Number(d.generation),
  };
}

/** The draft slot of one writer: one writer never erases another's draft. */
export function draftKey(kind: string, user: string, fileId: string, writerId: string): string {
  return `knownstate:${kind}-draft:${user}:${fileId}:${writerId}`;
}

export function draftPrefix(kind: string, user: string, fileId: string): string {
  return `knownstate:${kind}-draft:${user}:${fileId}:`;
}

/** What a draft slot holds (every draft store writes exactly this shape). */
export interface DraftRecord {
  kind: string;
  user: string;
  fileId: string;
  writerId: string;
  content: Content;
  baseVersion: number;
  baseContent: Content;
  generation: number;
  nextSeq: number;
  inflight: InflightJson | null;
}
