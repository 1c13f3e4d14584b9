#!/usr/bin/env bash
# stop_local_slurm.sh - stop only the daemons start_local_slurm.sh started,
# found by pidfile and checked by process name. Never kills by name pattern.
# Copy of /work/shared/tools/slurm/stop_local_slurm.sh; also puts back the
# /etc/slurm/slurm.conf that start_local_slurm.sh replaced, if there was one.
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # runuser, munged, slurmctld live in sbin; CI may not have it on PATH
BASE=${SLURM_LOCAL_DIR:-/tmp/local-slurm}

stop_pid() {  # stop_pid <expected comm> <pidfile>
  local name=$1 file=$2 pid
  [ -s "$file" ] || { echo "$name: no pidfile $file"; return 0; }
  pid=$(cat "$file")
  if [ "$(cat /proc/"$pid"/comm 2>/dev/null)" != "$name" ]; then
    echo "$name: pid $pid not running (or not $name); removing stale $file"
    rm -f "$file"; return 0
  fi
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then echo "$name: SIGKILL $pid"; kill -KILL "$pid"; fi
  rm -f "$file"
  echo "$name: stopped (pid $pid)"
}

# cancel jobs still queued/running on our cluster so no slurmstepd is orphaned
if [ -s "$BASE/slurmctld.pid" ] && kill -0 "$(cat "$BASE/slurmctld.pid")" 2>/dev/null; then
  jobs=$(squeue -h -o %A 2>/dev/null || true)
  if [ -n "$jobs" ]; then
    echo "$jobs" | xargs -r scancel || true
    for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

stop_pid slurmd    "$BASE/slurmd.pid"
stop_pid slurmctld "$BASE/slurmctld.pid"
stop_pid munged    "$BASE/munged.pid"   # only exists if the start script launched munged

# put back the slurm.conf that was there before start_local_slurm.sh (if any)
if [ -e "$BASE/slurm.conf.orig" ]; then
  cp -p "$BASE/slurm.conf.orig" /etc/slurm/slurm.conf && rm -f "$BASE/slurm.conf.orig"
  echo "restored /etc/slurm/slurm.conf"
fi
