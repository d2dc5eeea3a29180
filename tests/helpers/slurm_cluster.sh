#!/usr/bin/env bash
# A real one-node SLURM cluster for the tests marked `cluster` (make test-cluster): munged, slurmctld and slurmd
# from Debian's packages, every file of theirs (key, sockets, state, logs, pid files) in one state dir.
#
#   slurm_cluster.sh up        install if missing (root + apt), start what is not running, wait for the node idle
#   slurm_cluster.sh down      stop the daemons `up` started (by their pid files), nothing else
#   slurm_cluster.sh run CMD   up, CMD with SLURM_CONF exported, then stop the daemons this call started
#
# Where the cluster cannot be had (no root or no apt to install it, a daemon that will not start), `run` still
# runs CMD, with TEST_SLURM_SKIP set to the reason: the cluster tests skip with it. The state dir is one per clone
# (two worktrees get two clusters, on ports picked free at start); SLURM_TEST_DIR overrides it.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
D="${SLURM_TEST_DIR:-/tmp/slurm-test-$(printf %s "$ROOT" | md5sum | cut -c1-8)}"  # short: socket paths <108 chars
CONF="$D/slurm.conf"
NODE="$(hostname -s)"
STARTED_NOW=()  # daemons this invocation started

# Short SLURM timers so the tests wait on nothing but training: a requeued job may start 6 s after its requeue
# (AuthInfo cred_expire=5, the minimum; SLURM's default makes it wait 121 s), the scheduler looks every second
# (default 60 s), and a job step that ignores SIGTERM is SIGKILLed after KillWait=10 s (default 30 s), still far
# longer than a prompt exit. SLURM checks time limits (and sends --signal=SIG@N) every 30 s, hard-coded.
write_conf() {
    local ctld_port slurmd_port
    read -r ctld_port slurmd_port < <("$(command -v "$ROOT/.venv/bin/python" || command -v python3)" -c 'import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in ss))')
    cat > "$CONF" <<EOF
ClusterName=template-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge.socket,cred_expire=5
StateSaveLocation=$D/ctld
SlurmdSpoolDir=$D/slurmd
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
KillWait=10
MinJobAge=600
InactiveLimit=0
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName=test Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    # 2 GPUs that are not there (no device files): jobs may ask for --gpus-per-node as on a GPU cluster
    touch "$D/gpu0" "$D/gpu1"
    echo "NodeName=$NODE Name=gpu File=$D/gpu[0-1]" > "$D/gres.conf"
}

skip() { echo "SKIP: $*" >&2; echo "$*" > "$D/skip_reason"; return 3; }

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
    [ "$(id -u)" = 0 ] || { skip "SLURM is not installed and installing it needs root (apt-get install slurm-wlm munge)"; return; }
    command -v apt-get >/dev/null || { skip "SLURM is not installed and there is no apt-get to install it"; return; }
    echo "installing slurm-wlm and munge (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >"$D/apt.log" 2>&1 \
        || { apt-get update -q >>"$D/apt.log" 2>&1 && apt-get install -y -q slurm-wlm munge >>"$D/apt.log" 2>&1; } \
        || skip "apt-get install slurm-wlm munge failed (see $D/apt.log)"
}

# pid from a daemon's pid file when that process is alive and is that daemon
running() {
    local pid
    pid="$(cat "$D/$1.pid" 2>/dev/null)" || return 1
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && echo "$pid"
}

start() {  # start NAME COMMAND...: unless it runs already; wait for its pid file
    local name="$1"; shift
    running "$name" >/dev/null && return 0
    "$@" || { skip "$name did not start (see $D/$name.log)"; return; }
    for _ in $(seq 100); do running "$name" >/dev/null && break; sleep 0.1; done
    running "$name" >/dev/null || { skip "$name did not start (see $D/$name.log)"; return; }
    STARTED_NOW+=("$name")
    echo "$name" >> "$D/started"
}

up() {
    mkdir -p "$D" && chmod 711 "$D" && rm -f "$D/skip_reason"
    install || return
    mkdir -p "$D/ctld" "$D/slurmd"
    [ -s "$D/munge.key" ] || mungekey -c -k "$D/munge.key" || { skip "mungekey -c failed"; return; }
    start munged munged --socket="$D/munge.socket" --key-file="$D/munge.key" --pid-file="$D/munged.pid" \
        --log-file="$D/munged.log" --seed-file="$D/munged.seed" || return
    if ! running slurmctld >/dev/null; then
        running slurmd >/dev/null || write_conf  # new ports only when neither daemon holds the old ones
        start slurmctld slurmctld -c -f "$CONF" || return  # -c: no jobs from an earlier session
    fi
    start slurmd slurmd -f "$CONF" || return
    export SLURM_CONF="$CONF"
    for _ in $(seq 300); do
        case "$(sinfo -h -n "$NODE" -o %T 2>/dev/null)" in idle*|mixed*|allocated*) return 0;; esac
        sleep 0.2
    done
    skip "node $NODE did not become idle within 60 s: $(sinfo -N 2>&1 | tail -1)"
}

stop() {  # stop NAME: SIGTERM the pid in its pid file, wait for it to go
    local pid
    if pid="$(running "$1")"; then
        kill -TERM "$pid"
        for _ in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
        if [ -d "/proc/$pid" ]; then echo "$1 ($pid) still running 10 s after SIGTERM" >&2; fi
    fi
    sed -i "/^$1\$/d" "$D/started" 2>/dev/null
}

down() {  # the daemons named (default: all that `up` recorded), in reverse start order
    local names=("$@")
    [ ${#names[@]} -gt 0 ] || mapfile -t names < <(cat "$D/started" 2>/dev/null)
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do stop "${names[$i]}"; done
}

case "${1:-}" in
    up) up; status=$?; echo "export SLURM_CONF=$CONF"; exit $status;;
    down) down;;
    run)
        shift
        up
        if [ -f "$D/skip_reason" ]; then
            export TEST_SLURM_SKIP="$(cat "$D/skip_reason")"
        else
            export SLURM_CONF="$CONF" TEST_SLURM_CONF="$CONF"  # the tests submit to this cluster only
        fi
        trap '[ ${#STARTED_NOW[@]} -eq 0 ] || down "${STARTED_NOW[@]}"' EXIT  # also after Ctrl+C
        trap 'exit 130' INT TERM
        "$@"
        exit $?;;
    *) echo "usage: $0 up|down|run COMMAND..." >&2; exit 2;;
esac
