#!/usr/bin/env bash
# A multi-node cluster on one machine: N "hosts" made of Linux namespaces, for trying
# `ladder-run --nnodes N --hostfile ...` (Open MPI over TCP) without N machines.
#
#   scripts/cluster.sh up [N] [--cpus-per-node K]  create N hosts (default 2); idempotent
#   scripts/cluster.sh exec NODE CMD...  run CMD on NODE (an index 0..N-1 or a host name)
#   scripts/cluster.sh hostfile          print the path of the Open MPI hostfile
#   scripts/cluster.sh status            list the hosts, addresses, links and processes
#   scripts/cluster.sh down              remove everything (also after a failed run); idempotent
#
#   --name NAME (or LADDER_CLUSTER=NAME) picks the cluster, default "ladder"; several clusters
#   with different names can exist at once. `up N --cpus-per-node K` pins host I's processes to
#   K cores of its own (I*K..I*K+K-1, modulo the machine's) and gives it K slots, as a real host
#   has its own cores; by default every host shares all cores. Needs root and iproute2's `ip`.
#
# Each host is a network namespace plus a UTS namespace, both named NAME-nodeI, with:
#   - hostname NAME-nodeI (so Open MPI sees distinct nodes and never uses shared memory between
#     them), loopback, and eth0 = 10.213.0.(I+1)/24;
#   - eth0 is a veth whose peer sits on a bridge in a hub namespace NAME-hub: the network
#     exists only inside these namespaces; nothing is added to the machine's own network;
#   - /etc/hosts (through `ip netns exec`'s /etc/netns/NAME-nodeI/hosts) naming every host.
# The filesystem is shared (no mount namespace is needed): binaries, data and the state files
# below are the same paths on every host. In /run/ddp-ladder-cluster/NAME/:
#   hostfile   Open MPI hostfile, one line `NAME-nodeI slots=S` per host (S = cores per host)
#   rsh-agent  Open MPI's launch agent (plm_rsh_agent): `rsh-agent HOST CMD...` runs CMD on HOST
#              as ssh would, by entering HOST's namespaces
#   mca.env    the OMPI_MCA_* settings `exec` exports: the agent, and TCP (btl and oob) only on
#              10.213.0.0/24
# so that, on host 0, `mpirun --hostfile .../hostfile` (or ladder-run) reaches the other hosts
# without ssh. Example:
#   scripts/cluster.sh up 2
#   scripts/cluster.sh exec 0 target/release/ladder-run --nnodes 2 --nproc-per-node 1 \
#       --hostfile "$(scripts/cluster.sh hostfile)" target/release/level1-raw-ddp --epochs 1
#   scripts/cluster.sh down
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
NAME=${LADDER_CLUSTER:-ladder}
SUBNET=10.213.0
STATE_ROOT=/run/ddp-ladder-cluster

die() { echo "cluster.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,14p' "$SELF" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case $1 in
        --name) [[ $# -ge 2 ]] || die "--name needs a value"; NAME=$2; shift 2 ;;
        --name=*) NAME=${1#--name=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
[[ $NAME =~ ^[a-z][a-z0-9-]{0,39}$ ]] ||
    die "cluster name '$NAME' is not a valid host name prefix: expected 1-40 of [a-z0-9-], starting with a letter"
STATE=$STATE_ROOT/$NAME
HUB=$NAME-hub

preflight() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (creating network and UTS namespaces needs CAP_SYS_ADMIN); try: sudo $SELF $*"
    command -v ip >/dev/null || die "'ip' (iproute2) not found in PATH; install it: apt-get install iproute2"
    command -v nsenter >/dev/null && command -v unshare >/dev/null ||
        die "'nsenter' and 'unshare' (util-linux) not found in PATH; install them: apt-get install util-linux"
}

node_name() { echo "$NAME-node$1"; }
count_nodes() { [[ -f $STATE/nodes ]] && cat "$STATE/nodes" || echo 0; }

# Namespaces (net or UTS) whose processes belong to this cluster: print their PIDs.
cluster_pids() {
    local inodes=() f pid
    for f in /run/netns/"$NAME"-node* /run/netns/"$HUB" "$STATE"/uts/*; do
        [[ -e $f ]] && inodes+=("$(stat -L -c %i "$f" 2>/dev/null || true)")
    done
    [[ ${#inodes[@]} -gt 0 ]] || return 0
    for pid in /proc/[0-9]*; do
        pid=${pid#/proc/}
        [[ $pid == "$$" ]] && continue
        for f in net uts; do
            local ino
            ino=$(stat -L -c %i "/proc/$pid/ns/$f" 2>/dev/null) || continue
            if [[ " ${inodes[*]} " == *" $ino "* ]]; then echo "$pid"; break; fi
        done
    done
}

down() {
    local pids pid f tries=0
    # Processes first (an mpirun job left behind by a failed test), then the namespaces.
    while pids=$(cluster_pids) && [[ -n $pids ]]; do
        for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
        ((++tries > 50)) && die "processes still alive in cluster '$NAME' after SIGKILL: $pids"
        sleep 0.1
    done
    for f in /run/netns/"$NAME"-node* /run/netns/"$HUB"; do
        [[ -e $f ]] && { ip netns delete "$(basename "$f")" 2>/dev/null || die "cannot delete network namespace $(basename "$f")"; }
    done
    if [[ -d $STATE/uts ]]; then
        for f in "$STATE"/uts/*; do
            [[ -e $f ]] || continue
            umount "$f" 2>/dev/null || true
        done
    fi
    rm -rf "$STATE" /etc/netns/"$NAME"-node*
    return 0
}

is_up() {
    local n=$1 i ns
    [[ -f $STATE/complete && $(count_nodes) == "$n" ]] || return 1
    [[ -e /run/netns/$HUB ]] || return 1
    for ((i = 0; i < n; i++)); do
        ns=$(node_name "$i")
        [[ -e /run/netns/$ns ]] || return 1
        [[ $(nsenter --uts="$STATE/uts/$ns" hostname 2>/dev/null) == "$ns" ]] || return 1
        [[ $(ip -n "$ns" -br link show eth0 2>/dev/null) == *UP* ]] || return 1
    done
}

up() {
    local n=2 i ns slots cpn=""
    while [[ $# -gt 0 ]]; do
        case $1 in
            --cpus-per-node) [[ $# -ge 2 ]] || die "up: --cpus-per-node needs a value"; cpn=$2; shift 2 ;;
            --cpus-per-node=*) cpn=${1#*=}; shift ;;
            *) n=$1; shift ;;
        esac
    done
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 200 ]] || die "up: number of hosts '$n': expected a whole number in 1..200"
    [[ -z $cpn || ( $cpn =~ ^[0-9]+$ && $cpn -ge 1 && $cpn -le $(nproc) ) ]] ||
        die "up: --cpus-per-node '$cpn': expected a whole number in 1..$(nproc) (this machine's cores)"
    if is_up "$n" && [[ $(cat "$STATE/cpus-per-node" 2>/dev/null) == "$cpn" ]]; then
        echo "cluster '$NAME': $n hosts already up (hostfile $STATE/hostfile)"
        return 0
    fi
    down   # whatever a previous or different-sized cluster left
    mkdir -p "$STATE/uts"
    trap 'if [[ ! -f $STATE/complete ]]; then echo "cluster.sh: up failed; removing what was created" >&2; down; fi' EXIT
    slots=${cpn:-$(nproc)}
    echo "$cpn" >"$STATE/cpus-per-node"
    ip netns add "$HUB"
    ip -n "$HUB" link add br0 type bridge forward_delay 0 stp_state 0
    ip -n "$HUB" link set br0 up
    ip -n "$HUB" link set lo up
    : >"$STATE/hostfile.tmp"
    {
        echo "127.0.0.1 localhost"
        for ((i = 0; i < n; i++)); do echo "$SUBNET.$((i + 1)) $(node_name "$i")"; done
    } >"$STATE/hosts"
    for ((i = 0; i < n; i++)); do
        ns=$(node_name "$i")
        ip netns add "$ns"
        ip -n "$HUB" link add "p$i" type veth peer name eth0 netns "$ns"
        ip -n "$HUB" link set "p$i" master br0 up
        ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        touch "$STATE/uts/$ns"
        unshare --uts="$STATE/uts/$ns" hostname "$ns"
        mkdir -p "/etc/netns/$ns"
        cp "$STATE/hosts" "/etc/netns/$ns/hosts"
        echo "$ns slots=$slots" >>"$STATE/hostfile.tmp"
        if [[ -n $cpn ]]; then
            local c list=()
            for ((c = 0; c < cpn; c++)); do list+=($(((i * cpn + c) % $(nproc)))); done
            (IFS=,; echo "${list[*]}") >"$STATE/cpus.$ns"
        fi
    done
    mv "$STATE/hostfile.tmp" "$STATE/hostfile"
    cat >"$STATE/rsh-agent" <<EOF
#!/bin/bash
# Open MPI launch agent (plm_rsh_agent) for cluster '$NAME': "rsh-agent HOST COMMAND..." runs
# COMMAND on HOST through a shell, as "ssh HOST COMMAND..." would, and like ssh it fails
# (exit 255) when HOST cannot be reached over the network from where it runs.
host=\$1
shift
addr=\$(awk -v h="\$host" '\$2 == h { print \$1 }' "$STATE/hosts")
if [[ -z \$addr ]]; then
    echo "rsh-agent: host '\$host' is not in cluster '$NAME' (hosts: $NAME-node0..$NAME-node$((n - 1)))" >&2
    exit 255
fi
# A closed port answers with a refusal when the host is reachable (ssh would connect to 22).
err=\$(timeout 2 bash -c "exec 3<>/dev/tcp/\$addr/9" 2>&1)
if [[ \$err != *refused* ]]; then
    echo "rsh-agent: cannot reach host \$host (\$addr): \${err:-no answer within 2 s}" >&2
    exit 255
fi
# One process from here to the command (every step execs; bash -c execs a lone command), and it
# gets SIGKILL when mpirun, its parent, ends: a daemon whose mpirun is gone does not linger on
# the host (ssh's connection would have gone with mpirun too).
exec setpriv --pdeathsig KILL "$SELF" --name "$NAME" exec "\$host" bash -c "\$*"
EOF
    chmod +x "$STATE/rsh-agent"
    cat >"$STATE/mca.env" <<EOF
OMPI_MCA_plm_rsh_agent=$STATE/rsh-agent
OMPI_MCA_btl_tcp_if_include=$SUBNET.0/24
OMPI_MCA_oob_tcp_if_include=$SUBNET.0/24
EOF
    echo "$n" >"$STATE/nodes"
    # Host 0 reaches every other host over the bridge (a refused TCP connection proves it; no
    # ping needed).
    for ((i = 1; i < n; i++)); do
        local t err
        for t in $(seq 50); do
            err=$(ip netns exec "$(node_name 0)" timeout 1 bash -c "exec 3<>/dev/tcp/$SUBNET.$((i + 1))/9" 2>&1) || true
            [[ $err == *refused* ]] && break
            [[ $t == 50 ]] && die "host $(node_name 0) cannot reach $(node_name "$i") ($SUBNET.$((i + 1))): $err"
            sleep 0.1
        done
    done
    touch "$STATE/complete"
    echo "cluster '$NAME': $n hosts up: $(for ((i = 0; i < n; i++)); do printf '%s=%s.%d ' "$(node_name "$i")" "$SUBNET" $((i + 1)); done)"
    echo "hostfile: $STATE/hostfile"
}

exec_on() {
    [[ $# -ge 2 ]] || die "exec: expected NODE and a command (exec NODE CMD...)"
    local node=$1 n ns
    shift
    n=$(count_nodes)
    [[ -f $STATE/complete ]] || die "cluster '$NAME' is not up; run: $SELF --name $NAME up N"
    if [[ $node =~ ^[0-9]+$ ]]; then
        ((node < n)) || die "exec: node $node does not exist: cluster '$NAME' has nodes 0..$((n - 1))"
        ns=$(node_name "$node")
    else
        ns=$node
        [[ -e $STATE/uts/$ns ]] || die "exec: host '$ns' is not in cluster '$NAME' (hosts: $(node_name 0)..$(node_name $((n - 1))))"
    fi
    local envs=() pin=()
    mapfile -t envs <"$STATE/mca.env"
    [[ -f $STATE/cpus.$ns ]] && pin=(taskset -c "$(cat "$STATE/cpus.$ns")")
    exec ip netns exec "$ns" nsenter --uts="$STATE/uts/$ns" -- "${pin[@]}" env "${envs[@]}" "$@"
}

status() {
    local n i ns
    n=$(count_nodes)
    if [[ ! -f $STATE/complete ]]; then echo "cluster '$NAME': down"; return 0; fi
    echo "cluster '$NAME': $n hosts; hostfile $STATE/hostfile"
    for ((i = 0; i < n; i++)); do
        ns=$(node_name "$i")
        echo "  $ns: $(ip -n "$ns" -br addr show eth0 2>/dev/null | tr -s ' ')"
    done
    echo "  processes: $(cluster_pids | wc -l)"
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
    up) preflight up; up "$@" ;;
    down) preflight down; down; echo "cluster '$NAME': down" ;;
    exec) preflight exec; exec_on "$@" ;;
    hostfile) [[ -f $STATE/hostfile ]] || die "cluster '$NAME' is not up"; echo "$STATE/hostfile" ;;
    status) preflight status; status ;;
    ""|help) usage; [[ $cmd == help ]] ;;
    *) usage >&2; die "unknown command '$cmd': expected up, down, exec, hostfile or status" ;;
esac
