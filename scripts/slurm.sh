#!/usr/bin/env bash
# A real Slurm on the namespace cluster of scripts/cluster.sh: munged (one key), slurmctld on
# host 0 and one slurmd per host, so that `srun` and `sbatch` place ranks on the namespace hosts.
#
#   scripts/slurm.sh up [N]           the cluster's N hosts (default 2) and Slurm on them; idempotent
#   scripts/slurm.sh exec NODE CMD... run CMD on NODE with SLURM_CONF set (srun, sbatch, squeue...)
#   scripts/slurm.sh conf             print the path of slurm.conf
#   scripts/slurm.sh status           the hosts, then sinfo
#   scripts/slurm.sh down             stop Slurm and remove the cluster (also after a failure); idempotent
#
#   --name NAME (or LADDER_CLUSTER=NAME) picks the cluster, as for cluster.sh. Needs root and
#   Debian's slurm-wlm and munge (scripts/bootstrap.sh installs them).
#
# Everything lives in /run/ddp-ladder-cluster/NAME/slurm/ (removed by down): slurm.conf, munge.key
# and munged's socket, slurmctld's state, one spool directory per host (spool/HOST), the logs
# (*.log), a TMPDIR per host (tmp/HOST). Slurm's settings: SlurmUser root, munge authentication, proctrack/linuxproc, task/none
# (no cgroups), no accounting, select/cons_tres by core, one partition "ladder" (the default) of
# every host, each with the machine's cores (they share them). The daemons run inside the hosts'
# namespaces, so `cluster.sh down` ends them with everything else. Example:
#   scripts/slurm.sh up 2
#   scripts/slurm.sh exec 0 srun -N 2 -n 2 --mpi=pmix target/release/level1-raw-ddp --epochs 1
#   scripts/slurm.sh exec 0 sbatch scripts/examples/train.sbatch
#   scripts/slurm.sh down
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
CLUSTER=$(dirname "$SELF")/cluster.sh
NAME=${LADDER_CLUSTER:-ladder}

die() { echo "slurm.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,12p' "$SELF" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case $1 in
        --name) [[ $# -ge 2 ]] || die "--name needs a value"; NAME=$2; shift 2 ;;
        --name=*) NAME=${1#--name=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
STATE=/run/ddp-ladder-cluster/$NAME
DIR=$STATE/slurm
CONF=$DIR/slurm.conf
cluster() { bash "$CLUSTER" --name "$NAME" "$@"; }

preflight() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (the namespace hosts and Slurm's daemons need it); try: sudo $SELF $*"
    local b
    for b in munged slurmctld slurmd srun sbatch scontrol; do
        command -v "$b" >/dev/null ||
            die "'$b' not found in PATH; install Debian's Slurm: apt-get install slurm-wlm munge (or run scripts/bootstrap.sh)"
    done
}

# Whether Slurm answers and every host is idle or allocated (not down or unknown).
ready() {
    local n=$1 out
    out=$(cluster exec 0 env SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    [[ $(grep -cE ' (idle|alloc|mix)$' <<<"$out") == "$n" ]]
}

is_up() {
    local n=$1
    [[ -f $DIR/complete && $(cat "$STATE/nodes" 2>/dev/null) == "$n" ]] && ready "$n"
}

write_conf() {
    local n=$1 cpus i
    cpus=$(nproc)
    {
        echo "# Written by scripts/slurm.sh for cluster '$NAME' ($n hosts)."
        echo "ClusterName=$NAME"
        echo "SlurmctldHost=$NAME-node0(10.213.0.1)"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$DIR/munge.socket"
        echo "MpiDefault=none"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SchedulerType=sched/builtin"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "ReturnToService=2"
        echo "KillWait=10"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        # Per host: the hosts share /tmp, and mpi/pmix makes the same directory names on each.
        echo "TmpFS=$DIR/tmp/%n"
        echo "SlurmctldPidFile=$DIR/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/slurmd.%n.pid"
        echo "SlurmctldLogFile=$DIR/slurmctld.log"
        echo "SlurmdLogFile=$DIR/slurmd.%n.log"
        echo "SlurmctldDebug=info"
        echo "SlurmdDebug=info"
        for ((i = 0; i < n; i++)); do
            echo "NodeName=$NAME-node$i NodeAddr=10.213.0.$((i + 1)) CPUs=$cpus State=UNKNOWN"
        done
        echo "PartitionName=ladder Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
    } >"$CONF"
    # Slurm 22.05's slurmd loads a cgroup plugin even with proctrack/linuxproc and task/none, and
    # its autodetection fails where /sys/fs/cgroup is a tmpfs of v1 controllers (containers):
    # name the plugin there; on a cgroup2 mount autodetection works. None of the enabled plugins
    # creates cgroups.
    if [[ $(stat -fc %T /sys/fs/cgroup 2>/dev/null) == cgroup2fs ]]; then
        echo "CgroupPlugin=autodetect" >"$DIR/cgroup.conf"
    else
        echo "CgroupPlugin=cgroup/v1" >"$DIR/cgroup.conf"
    fi
}

up() {
    local n=${1:-2} i
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 200 ]] || die "up: number of hosts '$n': expected a whole number in 1..200"
    if is_up "$n"; then
        echo "slurm on cluster '$NAME': $n hosts already up (SLURM_CONF=$CONF)"
        return 0
    fi
    # Whatever a failed or different-sized start left: the cluster and its daemons go together.
    cluster down >/dev/null
    cluster up "$n"
    trap 'if [[ ! -f $DIR/complete ]]; then echo "slurm.sh: up failed; removing what was created (logs: see above)" >&2; for f in "$DIR"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }; done; cluster down >/dev/null; fi' EXIT
    mkdir -p "$DIR/state"
    for ((i = 0; i < n; i++)); do mkdir -p "$DIR/spool/$NAME-node$i" "$DIR/tmp/$NAME-node$i"; done
    dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$DIR/munge.key"
    write_conf "$n"
    # One munged for every host: its socket is a file, reachable from every network namespace.
    cluster exec 0 munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.socket" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
    cluster exec 0 slurmctld -f "$CONF"
    for ((i = 0; i < n; i++)); do
        cluster exec "$i" slurmd -f "$CONF" -N "$NAME-node$i"
    done
    for i in $(seq 100); do
        ready "$n" && break
        [[ $i == 100 ]] && die "Slurm did not report $n idle hosts within 20 s: $(cluster exec 0 env SLURM_CONF="$CONF" sinfo -N 2>&1 | tr '\n' ' ')"
        sleep 0.2
    done
    touch "$DIR/complete"
    echo "slurm on cluster '$NAME': $n hosts up; SLURM_CONF=$CONF"
}

status() {
    cluster status
    if [[ -f $DIR/complete ]]; then
        cluster exec 0 env SLURM_CONF="$CONF" sinfo -N
    else
        echo "slurm on cluster '$NAME': down"
    fi
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
    up) preflight up; up "$@" ;;
    down) cluster down ;;
    exec)
        [[ -f $DIR/complete ]] || die "slurm on cluster '$NAME' is not up; run: $SELF --name $NAME up N"
        [[ $# -ge 2 ]] || die "exec: expected NODE and a command (exec NODE CMD...)"
        node=$1
        shift
        cluster exec "$node" env SLURM_CONF="$CONF" "$@" ;;
    conf) [[ -f $DIR/complete ]] || die "slurm on cluster '$NAME' is not up"; echo "$CONF" ;;
    status) status ;;
    ""|help) usage; [[ $cmd == help ]] ;;
    *) usage >&2; die "unknown command '$cmd': expected up, down, exec, conf or status" ;;
esac
