-- The versioned document store. knownstate.impl.documents.store applies this schema.

-- One row per document. `version` is bumped by every accepted write and never goes back.
create table if not exists documents (
    id                 text primary key check (id ~ '^[A-Za-z0-9_-]{1,64}$'),
    kind               text not null check (kind in ('record', 'sheet')),
    schema             jsonb not null,
    content            jsonb not null check (jsonb_typeof(content) = 'object'),
    version            bigint not null default 1 check (version >= 1),
    created_by         text not null
);

-- Who may see a document (any row) and who may write it (can_write). No row: the document
-- does not exist as far as that user can tell.
create table if not exists document_acl (
    document_id text not null references documents (id) on delete cascade,
    user_id     text not null,
    can_write   boolean not null,
    primary key (document_id, user_id)
);

-- One row per accepted write, committed with it: the version it produced and the base version
-- the write carried. The primary key makes a version impossible to produce twice.
-- A save's (or create's) row is also its receipt: its identity (author, writer_id, save_seq) and
-- the fingerprint of the request, so a retry whose answer was lost is answered from it with the
-- original success, and the same identity with other content is refused.
create table if not exists document_history (
    document_id  text not null references documents (id) on delete cascade,
    version      bigint not null,
    base_version bigint not null,
    author       text not null,
    writer_id    text,
    save_seq     bigint,
    fingerprint  text,
    primary key (document_id, version)
);

-- A save identity names one save: it can produce one version, never two.
create unique index if not exists document_history_save
    on document_history (document_id, author, writer_id, save_seq) where writer_id is not null;

-- A request's deadline, checked at COMMIT. The document server answers 503 when a request
-- outlives its deadline; a write still in flight then (the database slow, or stopped) must not
-- land afterwards, when its client has been told it failed. So a write made for a request
-- carries, as the transaction-local setting knownstate.write_deadline, the last instant of the
-- database's clock at which it may commit (set just before it, in the same transaction); these
-- deferred triggers refuse the COMMIT of any later one. A write made without the setting
-- (seeding, the server-side writer, a check's own) is not checked.
create or replace function document_write_deadline() returns trigger
language plpgsql as $$
begin
    if clock_timestamp() > nullif(current_setting('knownstate.write_deadline', true), '')::timestamptz
    then
        raise exception 'the request''s deadline passed before this write could commit'
            using errcode = 'KS408',
                  hint = 'nothing of it was saved; the client was answered 503: it retries';
    end if;
    return null;
end
$$;

do $$
begin
    if not exists (select 1 from pg_trigger
                   where tgrelid = 'document_history'::regclass
                     and tgname = 'document_history_deadline') then
        create constraint trigger document_history_deadline
            after insert on document_history deferrable initially deferred
            for each row execute function document_write_deadline();
    end if;
    if not exists (select 1 from pg_trigger
                   where tgrelid = 'document_acl'::regclass
                     and tgname = 'document_acl_deadline') then
        create constraint trigger document_acl_deadline
            after insert or update or delete on document_acl deferrable initially deferred
            for each row execute function document_write_deadline();
    end if;
end
$$;
