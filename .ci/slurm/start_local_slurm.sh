#!/usr/bin/env bash
# start_local_slurm.sh - install (if needed), configure and start a real
# single-node Slurm cluster (Debian 12 packages, munge auth, no cgroups),
# then wait until the node is idle. Must run as root. Tested on Debian 12
# (Slurm 22.05). Stop with stop_local_slurm.sh (kills only what this script
# started, by pidfile).
#
# Adapted for vaecache's CI from /work/shared/tools/slurm/start_local_slurm.sh:
#   MinJobAge=4    (the minimum that still keeps `sbatch --wait` polling every
#                  2 s; it backs off to 32 s when MinJobAge/2 > 2, so a 3 s job
#                  took 42 s). Finished jobs leave `scontrol show job` after 4-60 s.
#   AuthInfo=cred_expire=$SLURM_CRED_EXPIRE (default 30): a requeued job waits
#                  this long before it may start again (Slurm default 120 s).
# Environment: SLURM_LOCAL_DIR (default /tmp/local-slurm), SLURM_WAIT_TIMEOUT
# (seconds to wait for the node to be idle, default 60), SLURM_CRED_EXPIRE.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # runuser, munged, slurmctld live in sbin; CI may not have it on PATH

BASE=${SLURM_LOCAL_DIR:-/tmp/local-slurm}
CONF=/etc/slurm/slurm.conf            # default path: clients need no SLURM_CONF
NODE=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(awk '/^MemTotal:/{printf "%d", $2/1024*0.9}' /proc/meminfo)
TIMEOUT=${SLURM_WAIT_TIMEOUT:-60}
CRED_EXPIRE=${SLURM_CRED_EXPIRE:-30}
t0=$(date +%s.%N)
el() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1fs", b-a}'; }

[ "$(id -u)" = 0 ] || { echo "must run as root" >&2; exit 1; }
if [ -s "$BASE/slurmctld.pid" ] && kill -0 "$(cat "$BASE/slurmctld.pid")" 2>/dev/null; then
  echo "slurmctld already running (pid $(cat "$BASE/slurmctld.pid")); run stop_local_slurm.sh first" >&2
  exit 1
fi

# 1. packages ---------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
   ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
  echo "[$(el)] packages installed: $(dpkg-query -W -f='${Version}' slurmctld)"
fi

mkdir -p "$BASE"/{state,spool,log}
rm -rf "$BASE"/state/* "$BASE"/spool/*      # fresh cluster, no old jobs

# 2. munge ------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then       # Debian postinst normally creates it
  install -d -o munge -g munge -m 0700 /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key --force
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged     # forks; pidfile /run/munge/munged.pid
  for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid "$BASE/munged.pid"   # marks "we started munged"
fi
munge -n | unmunge >/dev/null                    # fail fast if auth is broken
echo "[$(el)] munge OK"

# 3. slurm.conf -------------------------------------------------------------
cat > "$BASE/slurm.conf" <<EOF
ClusterName=localci
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=${CRED_EXPIRE}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MailProg=/bin/true
MinJobAge=4
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=${BASE}/state
SlurmdSpoolDir=${BASE}/spool
SlurmctldPidFile=${BASE}/slurmctld.pid
SlurmdPidFile=${BASE}/slurmd.pid
SlurmctldLogFile=${BASE}/log/slurmctld.log
SlurmdLogFile=${BASE}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=debug Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
EOF
mkdir -p "$(dirname "$CONF")"
if [ -e "$CONF" ] && ! cmp -s "$CONF" "$BASE/slurm.conf" && [ ! -e "$BASE/slurm.conf.orig" ]; then
  cp -p "$CONF" "$BASE/slurm.conf.orig"
fi
cp "$BASE/slurm.conf" "$CONF"

# 4. daemons (daemon mode; they write the pidfiles named in slurm.conf) -----
/usr/sbin/slurmctld
/usr/sbin/slurmd
echo "[$(el)] slurmctld pid $(cat "$BASE/slurmctld.pid" 2>/dev/null || echo ?), slurmd started"

# 5. wait until the node is idle -------------------------------------------
deadline=$(( $(date +%s) + TIMEOUT ))
state=""
while [ "$(date +%s)" -lt "$deadline" ]; do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.2
done
if [ "$state" != idle ]; then
  echo "node $NODE not idle after ${TIMEOUT}s (state='$state')" >&2
  scontrol show node "$NODE" >&2 || true
  tail -n 30 "$BASE"/log/*.log >&2 || true
  exit 1
fi
sinfo
echo "[$(el)] single-node Slurm ready: node=$NODE cpus=$CPUS mem=${MEM_MB}M"
