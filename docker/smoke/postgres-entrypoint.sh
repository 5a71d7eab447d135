#!/bin/sh
# First start: initdb, then create POSTGRES_USER (with POSTGRES_PASSWORD) and POSTGRES_DB.
# Every start: run postgres in the foreground, listening on all addresses.
set -eu
: "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}" "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    # UTF8 as the official image: a minimal root file system has no locale, and initdb
    # would pick SQL_ASCII, whose text psycopg hands back as bytes (SQLAlchemy then fails
    # reading the server version: "cannot use a string pattern on a bytes-like object").
    initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust \
        --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 -D "$PGDATA" >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    if [ "$POSTGRES_DB" != "postgres" ]; then
        createdb --username="$POSTGRES_USER" --owner="$POSTGRES_USER" "$POSTGRES_DB"
    fi
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    echo "postgres-entrypoint: initialised $PGDATA (user $POSTGRES_USER, db $POSTGRES_DB)"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
