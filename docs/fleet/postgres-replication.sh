#!/bin/bash
# Run once by the postgres image when the primary's data directory is created: the
# standby connects for replication as herdwick (a password, from any host of the network).
set -euo pipefail
echo "host replication herdwick all scram-sha-256" >> "$PGDATA/pg_hba.conf"
