-- access --
-- The document as %(user)s may see it. No ACL row: no result at all, so the answer to a
-- stranger (404) reveals nothing, not even the version.
SELECT d.kind, d.schema, d.content, d.version, a.can_write
FROM documents d
JOIN document_acl a ON a.document_id = d.id AND a.user_id = %(user)s
WHERE d.id = %(id)s

-- access_kind --
-- What a write needs to know first: the document's kind and schema, and whether %(user)s may
-- write it. No ACL row: no result (404, nothing revealed).
SELECT d.kind, d.schema, a.can_write
FROM documents d
JOIN document_acl a ON a.document_id = d.id AND a.user_id = %(user)s
WHERE d.id = %(id)s

-- save --
-- The compare-and-swap, as one statement: the UPDATE matches only while the stored version is
-- the save's base, the user may write, and this save identity (user, writer, seq) has not
-- saved yet. The history row, which is also the save's receipt, is written by the same
-- statement, so it commits with the content or not at all.
WITH saved AS (
    UPDATE documents d
    SET content = %(content)s, version = d.version + 1
    WHERE d.id = %(id)s
      AND d.version = %(expected)s
      AND EXISTS (SELECT 1 FROM document_acl a
                  WHERE a.document_id = d.id AND a.user_id = %(user)s AND a.can_write)
      AND NOT EXISTS (SELECT 1 FROM document_history h
                      WHERE h.document_id = d.id AND h.author = %(user)s
                        AND h.writer_id = %(writer)s AND h.save_seq = %(seq)s)
    RETURNING d.id, d.version
), history AS (
    INSERT INTO document_history
        (document_id, version, base_version, author, writer_id, save_seq, fingerprint)
    SELECT id, version, %(expected)s, %(user)s, %(writer)s, %(seq)s, %(fingerprint)s FROM saved
)
SELECT version FROM saved

-- missed --
-- Why the compare-and-swap matched no row, read after it (a new snapshot): the user's access
-- now, the receipt of this save identity if it saved before (a retry is answered from it), the
-- writer's highest seq here, and the stored version and content (the body of a 409).
SELECT a.can_write, r.fingerprint, r.version,
       (SELECT coalesce(max(save_seq), 0) FROM document_history
        WHERE document_id = %(id)s AND author = %(user)s AND writer_id = %(writer)s),
       d.version, d.content
FROM documents d
JOIN document_acl a ON a.document_id = d.id AND a.user_id = %(user)s
LEFT JOIN LATERAL (
    SELECT h.fingerprint, h.version FROM document_history h
    WHERE h.document_id = d.id AND h.author = %(user)s
      AND h.writer_id = %(writer)s AND h.save_seq = %(seq)s
) r ON true
WHERE d.id = %(id)s

-- create --
-- A new document whose id derives from the request's (user, writer, seq): a retry lands on the
-- same id and inserts nothing. The creator's ACL row and the history row (the create's
-- receipt) come with it.
WITH doc AS (
    INSERT INTO documents (id, kind, schema, content, version, created_by)
    VALUES (%(id)s, %(kind)s, %(schema)s, %(content)s, 1, %(user)s)
    ON CONFLICT (id) DO NOTHING
    RETURNING id, version
), acl AS (
    INSERT INTO document_acl (document_id, user_id, can_write)
    SELECT id, %(user)s, true FROM doc
), history AS (
    INSERT INTO document_history
        (document_id, version, base_version, author, writer_id, save_seq, fingerprint)
    SELECT id, 1, 0, %(user)s, %(writer)s, %(seq)s, %(fingerprint)s FROM doc
)
SELECT id, version FROM doc

-- created --
-- The receipt of an existing id's create, to tell a retried create from a different one.
SELECT fingerprint FROM document_history
WHERE document_id = %(id)s AND author = %(user)s AND writer_id = %(writer)s AND save_seq = %(seq)s

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
-- An administrative insert (tests, checks, `knownstate serve`): a document at version 1 with
-- its history row.
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

-- share --
-- The owner lets %(user)s read the document, and write it when can_write. Guarded: only the
-- document's creator, and never the owner's own row.
INSERT INTO document_acl (document_id, user_id, can_write)
SELECT d.id, %(user)s, %(can_write)s FROM documents d
WHERE d.id = %(id)s AND d.created_by = %(owner)s AND %(user)s <> %(owner)s
ON CONFLICT (document_id, user_id) DO UPDATE SET can_write = excluded.can_write
RETURNING can_write

-- unshare --
-- The owner takes %(user)s's access away (guarded like share). No row: it had none.
DELETE FROM document_acl a USING documents d
WHERE a.document_id = %(id)s AND a.user_id = %(user)s AND d.id = a.document_id
  AND d.created_by = %(owner)s AND %(user)s <> %(owner)s
RETURNING a.user_id

-- owner --
-- Who created the document, as %(user)s may see it (no ACL row: no result, nothing revealed),
-- and everyone's access: what a refused share is told, and what the owner is shown.
SELECT d.created_by, (SELECT jsonb_object_agg(user_id, can_write) FROM document_acl
                      WHERE document_id = d.id)
FROM documents d
JOIN document_acl a ON a.document_id = d.id AND a.user_id = %(user)s
WHERE d.id = %(id)s

-- all_documents --
-- Every document, for projections and for "nothing stored changed" checks.
SELECT id, kind, version, content FROM documents ORDER BY id

-- all_history --
SELECT document_id, version, base_version, author, writer_id, save_seq
FROM document_history ORDER BY document_id, version

-- applied --
-- Did the save (or create) of this user, writer and seq land? A check resolves a lost answer
-- with it.
SELECT version FROM document_history
WHERE document_id = %(id)s AND author = %(user)s AND writer_id = %(writer)s AND save_seq = %(seq)s

-- reset --
-- Empty every document table (between the examples of a check).
TRUNCATE documents, document_acl, document_history
