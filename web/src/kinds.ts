/**
 * Document kinds: what an id and a value may be, and how (and whether) three copies merge.
 *
 * The TypeScript twin of `model/document_kinds.py`. Both kinds are flat maps `id -> value`. A
 * `record`'s ids are the attribute ids of its schema, each typed (`text`, `number`, `bool`), and it
 * merges by attribute id; a `sheet`'s ids are cell references inside its size, and it does not
 * merge (a formula has no merge semantics: an explicit conflict is more honest than a silent one).
 */

export type Value = string | number | boolean;
export type Content = Record<string, Value>;
export type Patch = Record<string, Value | null>;
export type Schema = Record<string, unknown>;
/** A clash resolver: `resolve(id, base, local, stored) -> value` (`undefined`: the id is absent). */
export type Resolve = (id: string, base?: Value, local?: Value, stored?: Value) => Value | undefined;

export const MAX_KEYS = 500;
export const MAX_TEXT = 2000;
export const MAX_NUMBER = 2 ** 53;

/** A content, patch or schema does not fit the document's kind. The message names the problem. */
export class KindError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "KindError";
  }
}

/** This document kind does not merge: keep a copy, discard, or discard and reload. */
export class MergeUnsupported extends KindError {
  constructor(kind: string) {
    super(
      `${kind} documents do not merge: keep the local copy as a new document, ` +
        "discard it, or discard and reload",
    );
    this.name = "MergeUnsupported";
  }
}

function checkText(what: string, s: string): void {
  if (s.includes("\u0000")) throw new KindError(`${what} contains a NUL character`);
  if (!s.isWellFormed()) throw new KindError(`${what} is not valid Unicode (lone surrogate)`);
}

function checkNumber(what: string, v: unknown): void {
  if (typeof v !== "number") throw new KindError(`${what} must be a number, got ${typeof v}`);
  if (!Number.isFinite(v)) throw new KindError(`${what} must be a finite number`);
  if (Math.abs(v) > MAX_NUMBER) throw new KindError(`${what} is out of range (|x| <= 2**53)`);
}

function checkString(what: string, v: unknown): void {
  if (typeof v !== "string") throw new KindError(`${what} must be a string, got ${typeof v}`);
  if (v.length > MAX_TEXT) throw new KindError(`${what} is longer than ${MAX_TEXT} characters`);
  checkText(what, v);
}

/** Value equality that does not confuse `true` with `1`. */
export function same(a: unknown, b: unknown): boolean {
  return typeof a === typeof b && a === b;
}

export function sameContent(a: Content, b: Content): boolean {
  const ka = Object.keys(a);
  return ka.length === Object.keys(b).length && ka.every((k) => k in b && same(a[k], b[k]));
}

export const preferLocal: Resolve = (_id, _base, local) => local;
export const preferStored: Resolve = (_id, _base, _local, stored) => stored;

export abstract class Kind {
  abstract readonly name: string;
  readonly canMerge: boolean = false;

  abstract validateValue(schema: Schema, key: string, value: Value | null): void;

  validateContent(schema: Schema, content: Content): void {
    if (typeof content !== "object" || content === null || Array.isArray(content)) {
      throw new KindError(`${this.name} content must be an object of id -> value`);
    }
    const keys = Object.keys(content);
    if (keys.length > MAX_KEYS) throw new KindError(`${this.name} content has more than ${MAX_KEYS} ids`);
    for (const key of keys) {
      if (content[key] === null) throw new KindError(`content['${key}'] is null: omit the id to clear it`);
      this.validateValue(schema, key, content[key]);
    }
  }

  /** A patch maps ids to new values; `null` clears an id. */
  validatePatch(schema: Schema, patch: Patch): void {
    if (typeof patch !== "object" || patch === null || Object.keys(patch).length === 0) {
      throw new KindError("an edit is a non-empty map of id -> value (None clears)");
    }
    for (const [key, value] of Object.entries(patch)) this.validateValue(schema, key, value);
  }

  apply(content: Content, patch: Patch): Content {
    const out: Content = { ...content };
    for (const [key, value] of Object.entries(patch)) {
      if (value === null) delete out[key];
      else out[key] = value;
    }
    return out;
  }

  merge(_base: Content, _local: Content, _stored: Content, _resolve: Resolve): Content {
    throw new MergeUnsupported(this.name);
  }
}

/** Dynamic attributes keyed by attribute id; the schema names each attribute's type. */
export class RecordKind extends Kind {
  readonly name = "record";
  override readonly canMerge = true;

  validateValue(schema: Schema, key: string, value: Value | null): void {
    const attrs = (schema.attributes ?? {}) as Record<string, string>;
    const t = Object.hasOwn(attrs, key) ? attrs[key] : undefined;
    if (t === undefined) {
      checkText("attribute id", key);
      throw new KindError(`unknown attribute id '${key}'`);
    }
    if (value === null) return;
    const what = `attribute '${key}'`;
    if (t === "text") checkString(what, value);
    else if (t === "number") checkNumber(what, value);
    else if (typeof value !== "boolean") throw new KindError(`${what} must be a boolean, got ${typeof value}`);
  }

  /** Three-way merge by attribute id: a side that left an attribute as in the base takes the
   * other side's value; only an attribute both sides changed differently is a clash. */
  override merge(base: Content, local: Content, stored: Content, resolve: Resolve): Content {
    const out: Content = {};
    const keys = [...new Set([...Object.keys(base), ...Object.keys(local), ...Object.keys(stored)])];
    for (const key of keys.sort()) {
      const b = base[key], l = local[key], s = stored[key];
      let v: Value | undefined;
      if (same(l, s)) v = l;
      else if (same(l, b)) v = s;
      else if (same(s, b)) v = l;
      else v = resolve(key, b, l, s);
      if (v !== undefined && v !== null) out[key] = v;
    }
    return out;
  }
}

/** Cells keyed by reference (`A1` .. `ZZ99999`) inside the sheet's size. No merge. */
export class SheetKind extends Kind {
  readonly name = "sheet";
  static readonly CELL = /^([A-Z]{1,2})([1-9][0-9]{0,4})$/;

  static columnNumber(letters: string): number {
    let n = 0;
    for (const ch of letters) n = n * 26 + (ch.charCodeAt(0) - 64);
    return n;
  }

  validateValue(schema: Schema, key: string, value: Value | null): void {
    const m = SheetKind.CELL.exec(key);
    if (!m) {
      checkText("cell id", key);
      throw new KindError(`unknown cell id '${key}': a cell is a column letter and a row number, like B7`);
    }
    const cols = schema.cols as number, rows = schema.rows as number;
    if (SheetKind.columnNumber(m[1]) > cols || Number(m[2]) > rows) {
      throw new KindError(`unknown cell id '${key}': outside the sheet's ${cols} columns x ${rows} rows`);
    }
    if (value === null) return;
    const what = `cell '${key}'`;
    if (typeof value === "string") checkString(what, value);
    else checkNumber(what, value);
  }
}

export const KINDS: Record<string, Kind> = { record: new RecordKind(), sheet: new SheetKind() };

export function kindOf(name: string): Kind {
  const k = KINDS[name];
  if (!k) throw new KindError(`unknown document kind '${name}'; expected record or sheet`);
  return k;
}
