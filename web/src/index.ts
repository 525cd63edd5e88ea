/** The reference client: the library, and the driver contract installed on `globalThis`. */
export * from "./kinds.js";
export * from "./protocol.js";
export * from "./session.js";
export { FetchTransport } from "./http.js";
export { LocalStorageDrafts } from "./drafts.js";
export { attachLifecycle } from "./lifecycle.js";
import { driver } from "./driver.js";
import { Session } from "./session.js";

(globalThis as any).knownstateClient = driver({ reference: Session });
