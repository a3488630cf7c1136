#!/usr/bin/env bash
# One Ray cluster per Slurm job: the head on the job's first node, a worker on every other node, token auth on,
# the dashboard on the head's loopback only. What it prints says how a notebook connects.
#
#   sbatch cluster/slurm/ray-cluster.sh                         # leave the cluster up for a notebook
#   sbatch cluster/slurm/ray-cluster.sh -- python my_driver.py  # run a command on the head, then stop
#   salloc -N2 --gpus-per-node=8 --exclusive  then  bash cluster/slurm/ray-cluster.sh
#
# Sub-commands (the Slurm part computes addresses and calls these through srun; a test calls them without Slurm):
#   slurm [-- CMD...]   the default: start the cluster on this allocation (and run CMD on the head)
#   head [ARGS...]      start a head on this node and block (ARGS go to `ray start`)
#   worker [ARGS...]    start a worker on this node and block; joins MOLT_RAY_HEAD_ADDRESS
#   wait N              wait until N nodes are alive (MOLT_RAY_HEAD_ADDRESS), print the cluster's resources
#   token FILE          write a new random token to FILE, mode 0600 (never printed)
#   resources           print the GPUs and CPUs this node would give Ray
#
# Settings (environment; defaults in brackets):
#   MOLT_RAY_PORT [6379] GCS port; MOLT_RAY_CLIENT_PORT [10001] Ray Client port; MOLT_RAY_DASHBOARD_PORT [8265]
#   MOLT_RAY_JOB_DIR [$HOME/.molt-nb/slurm/$SLURM_JOB_ID] on a filesystem every node sees: the token and a copy of
#     this script go there
#   MOLT_RAY_TEMP_DIR [/tmp/molt-ray-$SLURM_JOB_ID] Ray's node-local temp dir (sockets: keep it short)
#   MOLT_RAY_NUM_GPUS / MOLT_RAY_NUM_CPUS: override what is read from the allocation (see `resources`)
#   MOLT_RAY_HEAD_IP: the head's address (default: the one Ray chooses); MOLT_RAY_NODE_IP: a worker's own address
#   MOLT_RAY_HEAD_ARGS / MOLT_RAY_WORKER_ARGS: more `ray start` flags; MOLT_SRUN_ARGS: more srun flags (e.g. Pyxis:
#     --container-image=... --container-mounts=/dev/shm:/dev/shm); MOLT_RAY_WAIT_S [600] how long nodes may take
#
# Never `ray stop` here: it kills every Ray of this user on the node. This script stops only what it started.
#
#SBATCH --job-name=molt-ray
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=molt-ray-%j.log

set -euo pipefail

say() { printf 'molt-ray: %s\n' "$*"; }
die() {
    printf 'molt-ray: error: %s\n' "$*" >&2
    exit 1
}

port() { printf '%s' "${MOLT_RAY_PORT:-6379}"; }
temp_dir() { printf '%s' "${MOLT_RAY_TEMP_DIR:-/tmp/molt-ray-${SLURM_JOB_ID:-$(id -u)}}"; }

# The GPUs of this node: an explicit count, else what Slurm gave this step, else what CUDA or the driver show, else 0
node_gpus() {
    local n
    if [[ -n ${MOLT_RAY_NUM_GPUS:-} ]]; then
        n=$MOLT_RAY_NUM_GPUS
    elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        n=$SLURM_GPUS_ON_NODE
    elif [[ -n ${SLURM_GPUS_PER_NODE:-} ]]; then
        n=${SLURM_GPUS_PER_NODE##*:} # "h100:8" or "8"
    elif [[ -n ${CUDA_VISIBLE_DEVICES:-} && $CUDA_VISIBLE_DEVICES != NoDevFiles ]]; then
        local ids
        IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
        n=${#ids[@]}
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    else
        n=0
    fi
    [[ $n =~ ^[0-9]+$ ]] || die "cannot read a GPU count from '$n': set MOLT_RAY_NUM_GPUS to this node's GPUs"
    printf '%s' "$n"
}

# The CPUs of this node: an explicit count, else Slurm's, else all this process may use
node_cpus() {
    local n=${MOLT_RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
    [[ $n =~ ^[0-9]+$ ]] || die "cannot read a CPU count from '$n': set MOLT_RAY_NUM_CPUS to this node's CPUs"
    printf '%s' "$n"
}

# Token auth for every Ray process this script starts (Ray reads both from the environment)
use_token() {
    local file=${MOLT_RAY_TOKEN_FILE:-}
    [[ -n $file && -r $file ]] ||
        die "no token file at '${file}': set MOLT_RAY_TOKEN_FILE to one (\`$0 token FILE\` makes one)"
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$file
    unset RAY_AUTH_TOKEN
}

need_ray() {
    command -v ray >/dev/null 2>&1 ||
        die "ray is not on PATH: activate the environment first (in the image: PATH=/opt/molt-rollout/bin:\$PATH)"
}

cmd_token() {
    local file=${1:?usage: token FILE}
    [[ ! -e $file ]] || die "$file exists: each job gets a new token (remove it, or point MOLT_RAY_TOKEN_FILE at it)"
    mkdir -p "$(dirname "$file")"
    (
        umask 077
        od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$file"
    )
    chmod 600 "$file"
}

cmd_resources() { printf 'num_gpus=%s num_cpus=%s\n' "$(node_gpus)" "$(node_cpus)"; }

cmd_head() {
    use_token
    need_ray
    local args=(--head --block --port="$(port)" --ray-client-server-port="${MOLT_RAY_CLIENT_PORT:-10001}"
        --dashboard-host=127.0.0.1 --dashboard-port="${MOLT_RAY_DASHBOARD_PORT:-8265}"
        --num-gpus="$(node_gpus)" --num-cpus="$(node_cpus)" --temp-dir="$(temp_dir)" --disable-usage-stats)
    [[ -z ${MOLT_RAY_HEAD_IP:-} ]] || args+=(--node-ip-address="$MOLT_RAY_HEAD_IP")
    local extra=()
    [[ -z ${MOLT_RAY_HEAD_ARGS:-} ]] || read -ra extra <<<"$MOLT_RAY_HEAD_ARGS"
    local recorded
    recorded="$(temp_dir)/ray_current_cluster" # where `ray start` writes the GCS address it chose, once it is up
    rm -f "$recorded"
    # detached (the subshell returns at once), so that `ray start` does not inherit a child it never reaps
    [[ -z ${MOLT_RAY_ADDRESS_FILE:-} ]] || (publish "$recorded" "$MOLT_RAY_ADDRESS_FILE" &)
    # exec: the srun step is `ray start --block` itself, which stops its own processes on SIGTERM
    exec ray start "${args[@]}" "${extra[@]}" "$@"
}

# Copy the address the head chose to the job dir (shared), where the node that launched it, maybe a login node, reads it
publish() {
    local i
    for ((i = 0; i < ${MOLT_RAY_WAIT_S:-600}; i++)); do
        if [[ -s $1 ]]; then
            cp "$1" "$2.part" && mv "$2.part" "$2"
            return 0
        fi
        sleep 1
    done
}

cmd_worker() {
    use_token
    need_ray
    local address=${MOLT_RAY_HEAD_ADDRESS:?set MOLT_RAY_HEAD_ADDRESS to the head\'s GCS address, host:port}
    local args=(--address="$address" --block --num-gpus="$(node_gpus)" --num-cpus="$(node_cpus)"
        --temp-dir="$(temp_dir)" --disable-usage-stats)
    [[ -z ${MOLT_RAY_NODE_IP:-} ]] || args+=(--node-ip-address="$MOLT_RAY_NODE_IP")
    local extra=()
    [[ -z ${MOLT_RAY_WORKER_ARGS:-} ]] || read -ra extra <<<"$MOLT_RAY_WORKER_ARGS"
    exec ray start "${args[@]}" "${extra[@]}" "$@"
}

cmd_wait() {
    local want=${1:?usage: wait N}
    use_token
    local address=${MOLT_RAY_HEAD_ADDRESS:?set MOLT_RAY_HEAD_ADDRESS to the head\'s GCS address, host:port}
    python3 - "$address" "$want" "${MOLT_RAY_WAIT_S:-600}" <<'PY'
import sys, time
import ray

address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + timeout
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        break
    if time.monotonic() > deadline:
        sys.exit(f"molt-ray: error: {len(alive)} of {want} nodes joined within {timeout:.0f} s: read the workers' "
                 "srun output in the job's log, and raise MOLT_RAY_WAIT_S if they were only slow")
    time.sleep(2)
res = ray.cluster_resources()
ips = ", ".join(sorted(n["NodeManagerAddress"] for n in alive))
print(f"molt-ray: {len(alive)} nodes up ({ips}): {res.get('GPU', 0):g} GPUs, {res.get('CPU', 0):g} CPUs")
ray.shutdown()
PY
}

started=() # the pids of the srun steps this script started: the only processes it ever stops

stop_started() {
    trap - EXIT INT TERM
    ((${#started[@]})) || return 0
    say "stopping this job's Ray nodes (srun pids ${started[*]})"
    kill -TERM "${started[@]}" 2>/dev/null || true
    local _ p alive
    for _ in $(seq 60); do
        alive=0
        for p in "${started[@]}"; do
            if kill -0 "$p" 2>/dev/null; then alive=1; fi
        done
        ((alive)) || return 0
        sleep 1
    done
    kill -KILL "${started[@]}" 2>/dev/null || true
}

# on_node NODE ARGS...: an srun step of one task on NODE, in the background (its pid joins `started`)
on_node() {
    local node=$1 extra=()
    shift
    [[ -z ${MOLT_SRUN_ARGS:-} ]] || read -ra extra <<<"$MOLT_SRUN_ARGS"
    srun --nodes=1 --ntasks=1 --overlap --nodelist="$node" "${extra[@]}" "$@" &
    started+=("$!")
}

cmd_slurm() {
    [[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_JOB_NODELIST:-} ]] ||
        die "not inside a Slurm allocation: submit it with \`sbatch $0\` or run it inside \`salloc\`; to start one node by hand, use \`$0 head\` and \`$0 worker\`"
    command -v srun >/dev/null 2>&1 || die "srun is not on PATH: run this on a Slurm node, inside the job"
    local nodes node head_node job_dir script workers=()
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ((${#nodes[@]})) || die "scontrol found no nodes in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
    head_node=${nodes[0]}
    workers=("${nodes[@]:1}")

    job_dir=${MOLT_RAY_JOB_DIR:-$HOME/.molt-nb/slurm/$SLURM_JOB_ID}
    mkdir -p "$job_dir"
    chmod 700 "$job_dir"
    export MOLT_RAY_TOKEN_FILE=$job_dir/auth_token MOLT_RAY_ADDRESS_FILE=$job_dir/head_address
    export MOLT_RAY_TEMP_DIR MOLT_RAY_WAIT_S=${MOLT_RAY_WAIT_S:-600}
    MOLT_RAY_TEMP_DIR=$(temp_dir)
    cmd_token "$MOLT_RAY_TOKEN_FILE"
    use_token
    rm -f "$MOLT_RAY_ADDRESS_FILE"
    script=$job_dir/ray-cluster.sh # under sbatch, $0 is Slurm's copy on this node only: the steps run this one
    cp "$0" "$script"

    trap stop_started EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT
    say "job $SLURM_JOB_ID: head on $head_node, ${#workers[@]} worker node(s); job dir $job_dir"
    on_node "$head_node" bash "$script" head
    local head_pid=${started[0]} i
    for ((i = 0; i < MOLT_RAY_WAIT_S; i++)); do
        [[ ! -s $MOLT_RAY_ADDRESS_FILE ]] || break
        kill -0 "$head_pid" 2>/dev/null || die "the head on $head_node stopped before it was up: its output is above"
        sleep 1
    done
    [[ -s $MOLT_RAY_ADDRESS_FILE ]] || die "the head on $head_node was not up within $MOLT_RAY_WAIT_S s (MOLT_RAY_WAIT_S)"
    export MOLT_RAY_HEAD_ADDRESS
    MOLT_RAY_HEAD_ADDRESS=$(<"$MOLT_RAY_ADDRESS_FILE")
    say "head up at $MOLT_RAY_HEAD_ADDRESS"
    for node in "${workers[@]}"; do
        on_node "$node" bash "$script" worker
    done
    srun --nodes=1 --ntasks=1 --overlap --nodelist="$head_node" bash "$script" wait $((${#workers[@]} + 1))

    local client=${MOLT_RAY_CLIENT_PORT:-10001} dash=${MOLT_RAY_DASHBOARD_PORT:-8265}
    cat <<EOF
molt-ray: the cluster is up. Ray Client: port $client on $head_node; dashboard: 127.0.0.1:$dash on $head_node only.
molt-ray: the token is in $MOLT_RAY_TOKEN_FILE (mode 0600; copy it with scp, never print it).
molt-ray: from your machine (add -J LOGIN_NODE if $head_node is reached through one):
    ssh -N -L 10001:127.0.0.1:$client -L 8265:127.0.0.1:$dash $head_node
  then in the notebook:
    from molt_nb.controller import connect
    connect("ray://127.0.0.1:10001", token=open("PATH_OF_YOUR_COPY_OF_auth_token").read().strip())
EOF
    if (($#)); then
        say "running on $head_node: $*"
        local rc=0
        RAY_ADDRESS=$MOLT_RAY_HEAD_ADDRESS on_node "$head_node" "$@"
        wait "${started[-1]}" || rc=$?
        say "the command ended (exit $rc): stopping the cluster"
        exit "$rc"
    fi
    say "the cluster stays up until the job ends: scancel $SLURM_JOB_ID"
    wait "$head_pid" || true
    die "the head on $head_node stopped: its output is above"
}

usage() { sed -n '2,/^#SBATCH/{/^#SBATCH/d;s/^# \{0,1\}//;p}' "$0"; }

main() {
    local mode=${1:-slurm}
    case $mode in
    head | worker | wait | token | resources)
        shift
        "cmd_$mode" "$@"
        ;;
    slurm | --)
        (($# == 0)) || shift
        [[ ${1:-} != -- ]] || shift
        cmd_slurm "$@"
        ;;
    -h | --help) usage ;;
    *) die "unknown sub-command '$mode': one of slurm, head, worker, wait, token, resources (--help says more)" ;;
    esac
}

main "$@"
