/** The mutants bundle: the reference client and every mutant of the catalogue, chosen per tab by
 * `open({..., mutant})`. Used by `knownstate mutants document-session --client browser` only. */
import { driver } from "./driver.js";
import { MUTANTS } from "./mutants.js";
import { Session } from "./session.js";

(globalThis as any).knownstateClient = driver({ reference: Session, ...MUTANTS });
