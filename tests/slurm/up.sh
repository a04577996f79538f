#!/usr/bin/env bash
# Start a real one-node Slurm (slurmctld + slurmd, munge auth) on this machine, as root.
# Idempotent: installs only what is missing, starts only what is not running, and returns
# as soon as `sinfo` shows the node idle. Prints `export SLURM_CONF=...` on stdout (last line);
# every client (sbatch, srun, sinfo, squeue, scontrol, submitit) must see that variable,
# or pass SLURM_LINK_ETC=1 to also link /etc/slurm/slurm.conf to it.
#
#   eval "$(./up.sh | tail -1)"      # then: sinfo; sbatch ...
#   ./down.sh                        # stop both daemons (and munged with MUNGE_STOP=1)
#
# Knobs (environment):
#   SLURM_DIR      state/spool/log/pid/conf dir           (default /tmp/stratagem-slurm)
#   SLURM_CPUS     CPUs the node advertises               (default: what `slurmd -C` finds;
#                  more than the machine has -> SlurmdParameters=config_overrides, so several
#                  small jobs can run at once on 2 cores)
#   SLURM_PARTITION partition name                         (default debug)
#   SLURM_FEATURES node features for --constraint, comma-separated (default local)
#   SLURM_CTLD_PORT / SLURMD_PORT                         (default 6817 / 6818)
#   SLURM_WAIT     seconds to wait for the node to be idle (default 30)
#   SLURM_CRED_EXPIRE  AuthInfo=cred_expire: also the delay before a requeued job restarts
#                  (Slurm's default 120 s; default here 10 s)
#   SLURM_DEF_MEM_PER_CPU  MB: Slurm counts memory (CR_Core_Memory) and a job that asks for none
#                  gets this much per allocated CPU (DefMemPerCPU); unset: memory is not counted
set -euo pipefail

SLURM_DIR=${SLURM_DIR:-/tmp/stratagem-slurm}
PARTITION=${SLURM_PARTITION:-debug}
CTLD_PORT=${SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
WAIT=${SLURM_WAIT:-30}
CONF=$SLURM_DIR/slurm.conf
log() { echo "[slurm up] $*" >&2; }
t0=$(date +%s.%N)

# 1. install (skipped when present)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurm-wlm + munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # slurmctld slurmd slurm-client munge: 8 packages; slurm-wlm pulls ~43 (plugins) for the same result
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# 2. munge: key (the package makes one; make it if absent) and daemon, as the munge user
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
  else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
chmod 755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  rm -f /run/munge/munge.socket.2.lock
  su -s /bin/sh munge -c /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || { log "munged did not come up"; exit 1; }
fi

# 3. slurm.conf in SLURM_DIR (rewritten only when absent, so a running cluster keeps its config)
HOST=$(hostname -s)
mkdir -p "$SLURM_DIR"/{state,spool,log,run}
if [ ! -s "$CONF" ]; then
  # NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105
  read -r -a HW <<<"$(slurmd -C | head -1)"
  HAVE_CPUS=$(printf '%s\n' "${HW[@]}" | sed -n 's/^CPUs=//p')
  MEM=$(printf '%s\n' "${HW[@]}" | sed -n 's/^RealMemory=//p')
  CPUS=${SLURM_CPUS:-$HAVE_CPUS}
  OVERRIDES=""
  FEATURES=${SLURM_FEATURES:-local}  # what --constraint can ask for
  [ "$CPUS" -gt "$HAVE_CPUS" ] && OVERRIDES="SlurmdParameters=config_overrides"
  SELECT="SelectTypeParameters=CR_Core"
  [ -n "${SLURM_DEF_MEM_PER_CPU:-}" ] && SELECT="SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$SLURM_DEF_MEM_PER_CPU"
  cat >"$CONF" <<EOF
# one-node Slurm for tests (written by up.sh)
ClusterName=stratagem
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=${SLURM_CRED_EXPIRE:-10}
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$SLURM_DIR/log/jobcomp.txt
SchedulerType=sched/builtin
# test every pending job each 2 s (default 60): a requeued job starts soon after cred_expire
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
$SELECT
ReturnToService=2
# keep finished jobs visible to squeue/scontrol for 5 min (there is no sacct database)
MinJobAge=300
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/run/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/run/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
$OVERRIDES
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM Features=$FEATURES State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
fi
export SLURM_CONF=$CONF
[ "${SLURM_LINK_ETC:-0}" = 1 ] && { mkdir -p /etc/slurm; ln -sf "$CONF" /etc/slurm/slurm.conf; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# 4. daemons (-i: ignore state of a previous run would lose queued jobs, so start clean only
#    when the state dir is empty: -c clears it)
if ! alive "$SLURM_DIR/run/slurmctld.pid"; then
  log "starting slurmctld"
  slurmctld -f "$CONF"
fi
if ! alive "$SLURM_DIR/run/slurmd.pid"; then
  log "starting slurmd"
  slurmd -f "$CONF"
fi

# 5. wait for the node to be idle (or mixed/allocated: already running jobs)
ok=""
for _ in $(seq $((WAIT * 5))); do
  st=$(sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
  case "$st" in idle|mixed|allocated|completing) ok=1; break ;; esac
  sleep 0.2
done
if [ -z "$ok" ]; then
  log "node not idle after ${WAIT}s (state: ${st:-none}); logs in $SLURM_DIR/log"
  scontrol -f "$CONF" show node "$HOST" >&2 || true
  tail -5 "$SLURM_DIR"/log/*.log >&2 || true
  exit 1
fi
t1=$(date +%s.%N)
log "node $HOST $st in $(echo "$t1 - $t0" | bc 2>/dev/null || python3 -c "print(round($t1-$t0,2))")s"
echo "export SLURM_CONF=$CONF"
