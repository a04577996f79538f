#!/usr/bin/env bash
# Stop the one-node Slurm that up.sh started, by its pid files; idempotent.
#   SLURM_DIR   as for up.sh (default /tmp/stratagem-slurm)
#   MUNGE_STOP=1  also stop munged (by /run/munge/munged.pid)
#   SLURM_CLEAN=1 also remove SLURM_DIR (state, logs, conf)
set -uo pipefail
SLURM_DIR=${SLURM_DIR:-/tmp/stratagem-slurm}
log() { echo "[slurm down] $*" >&2; }

stop() {  # stop <pidfile> <name>: SIGTERM, wait up to 10 s, then SIGKILL
  local f=$1 name=$2 pid
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$name ($pid) still alive: SIGKILL"; kill -KILL "$pid"; fi
    log "stopped $name ($pid)"
  fi
  rm -f "$f"
}

# cancel what is still queued/running so no slurmstepd/job process outlives the daemons
if [ -s "$SLURM_DIR/slurm.conf" ] && [ -s "$SLURM_DIR/run/slurmctld.pid" ] \
   && kill -0 "$(cat "$SLURM_DIR/run/slurmctld.pid")" 2>/dev/null; then
  SLURM_CONF=$SLURM_DIR/slurm.conf scancel --full --quiet --user=root 2>/dev/null || true
  for _ in $(seq 50); do
    [ -z "$(SLURM_CONF=$SLURM_DIR/slurm.conf squeue -h -t R,CG,PD 2>/dev/null)" ] && break; sleep 0.2
  done
fi
stop "$SLURM_DIR/run/slurmd.pid" slurmd
stop "$SLURM_DIR/run/slurmctld.pid" slurmctld
if [ "${MUNGE_STOP:-0}" = 1 ]; then stop /run/munge/munged.pid munged; fi
if [ "${SLURM_CLEAN:-0}" = 1 ]; then rm -rf "$SLURM_DIR"; log "removed $SLURM_DIR"; fi
exit 0
