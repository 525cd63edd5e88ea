-- access --
-- The document as %(user)s may see it. No ACL row: no result at all, so the answer to a
-- stranger (404) reveals nothing, not even the version.
SELECT d.kind, d.schema, d.content, d.version, a.can_write
FROM documents d
JOIN document_acl a ON a.document_id = d.id AND a.user_id = %(user)s
WHERE d.id = %(id)s

-- save --
-- The compare-and-swap, as one statement: the UPDATE matches only while the stored version is
-- the save's base and the user may write. The history row and the writer's save receipt are
-- written by the same statement, so they commit with the content or not at all.
WITH saved AS (
    UPDATE documents d
    SET content = %(content)s, version = d.version + 1
    WHERE d.id = %(id)s
      AND d.version = %(expected)s
      AND EXISTS (SELECT 1 FROM document_acl a
                  WHERE a.document_id = d.id AND a.user_id = %(user)s AND a.can_write)
    RETURNING d.id, d.version
), history AS (
    INSERT INTO document_history (document_id, version, base_version, author, writer_id, save_seq)
    SELECT id, version, %(expected)s, %(user)s, %(writer)s, %(seq)s FROM saved
), receipt AS (
    INSERT INTO document_saves (document_id, writer_id, save_seq, fingerprint, version)
    SELECT id, %(writer)s, %(seq)s, %(fingerprint)s, version FROM saved
    ON CONFLICT (document_id, writer_id) DO UPDATE
        SET save_seq = excluded.save_seq, fingerprint = excluded.fingerprint, version = excluded.version
)
SELECT version FROM saved

-- receipt --
-- The last save applied for this writer: a retry with the same seq and fingerprint is answered
-- with the version it produced (the original success), never a conflict against itself.
SELECT save_seq, fingerprint, version FROM document_saves
WHERE document_id = %(id)s AND writer_id = %(writer)s

-- current --
-- The stored version and content, for the body of a 409 (read after the CAS missed).
SELECT version, content FROM documents WHERE id = %(id)s

-- create --
-- A new document whose id derives from the request's (user, writer, seq): a retry lands on the
-- same id and inserts nothing. The creator's ACL row and the history row come with it.
WITH doc AS (
    INSERT INTO documents (id, kind, schema, content, version, created_by, create_fingerprint)
    VALUES (%(id)s, %(kind)s, %(schema)s, %(content)s, 1, %(user)s, %(fingerprint)s)
    ON CONFLICT (id) DO NOTHING
    RETURNING id, version
), acl AS (
    INSERT INTO document_acl (document_id, user_id, can_write)
    SELECT id, %(user)s, true FROM doc
), history AS (
    INSERT INTO document_history (document_id, version, base_version, author, writer_id, save_seq)
    SELECT id, 1, 0, %(user)s, %(writer)s, %(seq)s FROM doc
)
SELECT id, version FROM doc

-- created --
-- Who created an existing id and with what, to tell a retried create from a different one.
SELECT create_fingerprint FROM documents WHERE id = %(id)s

-- server_write --
-- The server-side writer (the "AI write"): an atomic patch, at any time; a null value clears
-- an id. It bumps the version like any write, so a session based on the old version conflicts.
WITH w AS (
    UPDATE documents
    SET content = jsonb_strip_nulls(content || %(patch)s), version = version + 1
    WHERE id = %(id)s
    RETURNING id, version, content
), history AS (
    INSERT INTO document_history (document_id, version, base_version, author)
    SELECT id, version, version - 1, 'server' FROM w
)
SELECT version, content FROM w

-- kind_schema --
-- A document's kind and schema (for validating a server-side patch).
SELECT kind, schema FROM documents WHERE id = %(id)s

-- seed --
-- An administrative insert (tests, checks): a document at version 1 with its history row.
WITH doc AS (
    INSERT INTO documents (id, kind, schema, content, version, created_by)
    VALUES (%(id)s, %(kind)s, %(schema)s, %(content)s, 1, %(owner)s)
    RETURNING id
)
INSERT INTO document_history (document_id, version, base_version, author)
SELECT id, 1, 0, %(owner)s FROM doc

-- grant --
-- Let %(user)s see the document, and write it when can_write.
INSERT INTO document_acl (document_id, user_id, can_write)
VALUES (%(id)s, %(user)s, %(can_write)s)
ON CONFLICT (document_id, user_id) DO UPDATE SET can_write = excluded.can_write

-- revoke --
DELETE FROM document_acl WHERE document_id = %(id)s AND user_id = %(user)s

-- all_documents --
-- Every document, for projections and for "nothing stored changed" checks.
SELECT id, kind, version, content FROM documents ORDER BY id

-- all_history --
SELECT document_id, version, base_version, author, writer_id, save_seq
FROM document_history ORDER BY document_id, version

-- applied --
-- Did the save (or create) of this writer and seq land? A check resolves a lost answer with it.
SELECT version FROM document_history
WHERE document_id = %(id)s AND writer_id = %(writer)s AND save_seq = %(seq)s

-- reset --
-- Empty every document table (between the examples of a check).
TRUNCATE documents, document_acl, document_saves, document_history
