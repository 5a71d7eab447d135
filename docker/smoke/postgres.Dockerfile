# A postgres:16 stand-in for machines that cannot pull from Docker Hub: PostgreSQL from
# Debian bookworm's packages (15), with the official image's contract that
# docker-compose.yml relies on: POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB create the
# role and database on first start, data in /var/lib/postgresql/data (a volume),
# password (scram) auth from other containers, pg_isready on PATH.
ARG DEBIAN_IMAGE=qkscope-smoke-debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
USER postgres
EXPOSE 5432
CMD ["/usr/local/bin/postgres-entrypoint.sh"]
