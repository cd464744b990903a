#!/usr/bin/env bash
# A real single-node Slurm on localhost for the slow test tier (no systemd: daemons are started directly).
#
#   scripts/slurm_localhost.sh up   [DIR]   install if missing, start munged + slurmctld + slurmd, wait for an idle node
#   scripts/slurm_localhost.sh down [DIR]   stop the daemons this script started (by their pid files) and remove DIR
#   scripts/slurm_localhost.sh env  [DIR]   print the export lines for a cluster that is up
#   scripts/slurm_localhost.sh without CMD [ARGS...]
#                                           run CMD as on a machine without Slurm: in a private mount namespace where
#                                           every Slurm command on PATH is hidden, with SLURM_CONF unset (CI runs the
#                                           fast test tier so, to prove it needs no Slurm, even where Slurm is installed)
#
# DIR defaults to /tmp/taxbench-slurm. `up` prints `export SLURM_CONF=... PATH=...` lines: eval them (or source
# DIR/env.sh) so that sbatch/squeue/submitit use this cluster.
#
# Settings (environment):
#   SLURM_CTLD_PORT / SLURMD_PORT  ports (default 6817 / 6818; `up` refuses ports that are in use)
#   SLURM_CPUS                     CPUs the node advertises (default: max(nproc, 4); SlurmdParameters=config_overrides
#                                  lets a 2-core machine run 4-task jobs)
#   SLURM_KILL_WAIT                seconds between scancel's SIGTERM and SIGKILL (default 1; Slurm's own default is 30)
#   SLURM_FAKE_GPUS                number of fake GPUs (gres gpu:fake:N backed by mknod character devices; default 0)
#
# Job accounting: submitit polls job state with `sacct`, which has no data without slurmdbd. We chose NOT to run
# slurmdbd (a database server is heavy for CI): DIR/bin/sacct is a stand-in that answers submitit's one query
# (`sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...]`) from `squeue -h -t all`, which still lists a job for
# MinJobAge seconds after it ends. DIR/bin goes first on PATH through the printed export lines.
set -euo pipefail

ACTION=${1:-}
DIR=${2:-/tmp/taxbench-slurm}
CTLD_PORT=${SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
FAKE_GPUS=${SLURM_FAKE_GPUS:-0}
KILL_WAIT=${SLURM_KILL_WAIT:-1}
CPUS=${SLURM_CPUS:-$(( $(nproc) > 4 ? $(nproc) : 4 ))}

die() { echo "slurm_localhost: $*" >&2; exit 1; }

install_if_missing() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and this is not root; install slurmctld slurmd slurm-client munge"
    echo "slurm_localhost: installing slurmctld slurmd slurm-client munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

port_in_use() {
    python3 - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        sys.exit(0)
sys.exit(1)
EOF
}

write_config() {
    local host mem
    host=$(hostname -s)
    mem=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) - 1024 ))
    mkdir -p "$DIR"/{state,spool,log,run,bin,munge,dev}
    # munged runs as the munge user and must reach its socket folder, also when DIR came from `mktemp -d` (mode 0700).
    chmod a+x "$DIR"
    local gres_types="" node_gres=""
    if [ "$FAKE_GPUS" -gt 0 ]; then
        gres_types="GresTypes=gpu"
        node_gres="Gres=gpu:fake:$FAKE_GPUS"
        : > "$DIR/gres.conf"
        for ((i = 0; i < FAKE_GPUS; i++)); do
            [ -e "$DIR/dev/fakegpu$i" ] || mknod "$DIR/dev/fakegpu$i" c 195 "$i"
        done
        echo "Name=gpu Type=fake File=$DIR/dev/fakegpu[0-$((FAKE_GPUS - 1))]" > "$DIR/gres.conf"
    fi
    cat > "$DIR/slurm.conf" <<EOF
ClusterName=taxbench
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=300
KillWait=$KILL_WAIT
MailProg=/bin/true
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
$gres_types
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$mem $node_gres State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    cat > "$DIR/bin/sacct" <<'EOF'
#!/usr/bin/env bash
# Stand-in for sacct (no slurmdbd here): answers submitit's `sacct -o JobID,State,NodeList --parsable2 -j IDS`.
ids=""
while [ $# -gt 0 ]; do
    case "$1" in
        -j) ids="${ids:+$ids,}$2"; shift 2 ;;
        -j*) ids="${ids:+$ids,}${1#-j}"; shift ;;
        *) shift ;;
    esac
done
echo "JobID|State|NodeList"
[ -n "$ids" ] && squeue -h -t all -j "$ids" -o '%i|%T|%N' 2>/dev/null
exit 0
EOF
    chmod +x "$DIR/bin/sacct"
    cat > "$DIR/env.sh" <<EOF
export SLURM_CONF=$DIR/slurm.conf
export PATH=$DIR/bin:\$PATH
EOF
}

start_munge() {
    if [ -f "$DIR/run/munged.pid" ] && kill -0 "$(cat "$DIR/run/munged.pid")" 2>/dev/null; then
        return
    fi
    [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing; reinstall munge (its install creates the key)"
    mkdir -p /run/munge
    chown munge:munge /run/munge "$DIR/munge"
    # Our own socket and pid file, so that a system munged (if any) is left alone.
    runuser -u munge -- /usr/sbin/munged --socket="$DIR/munge/munge.socket" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
    for _ in $(seq 50); do [ -s "$DIR/munge/munged.pid" ] && break; sleep 0.1; done
    cp "$DIR/munge/munged.pid" "$DIR/run/munged.pid"
}

wait_idle() {
    local state=""
    for _ in $(seq 100); do
        state=$(SLURM_CONF="$DIR/slurm.conf" sinfo -h -o '%t' 2>/dev/null | head -1 || true)
        case "$state" in idle|mix|alloc) return 0 ;; esac
        sleep 0.2
    done
    die "node did not become idle (state '$state'); see $DIR/log/slurmctld.log and $DIR/log/slurmd.log"
}

up() {
    install_if_missing
    if [ -f "$DIR/run/slurmctld.pid" ] && kill -0 "$(cat "$DIR/run/slurmctld.pid")" 2>/dev/null; then
        echo "slurm_localhost: already up in $DIR" >&2
        cat "$DIR/env.sh"
        return
    fi
    for port in "$CTLD_PORT" "$SLURMD_PORT"; do
        port_in_use "$port" && die "port $port is in use; set SLURM_CTLD_PORT / SLURMD_PORT to free ports"
    done
    write_config
    start_munge
    export SLURM_CONF="$DIR/slurm.conf"
    /usr/sbin/slurmctld -i -f "$SLURM_CONF"
    /usr/sbin/slurmd -f "$SLURM_CONF"
    wait_idle
    echo "slurm_localhost: up in $DIR (node $(hostname -s), $CPUS CPUs, $FAKE_GPUS fake GPUs)" >&2
    cat "$DIR/env.sh"
}

stop_pidfile() {
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$file"
}

down() {
    [ -d "$DIR" ] || return 0
    stop_pidfile "$DIR/run/slurmd.pid"
    stop_pidfile "$DIR/run/slurmctld.pid"
    stop_pidfile "$DIR/run/munged.pid"
    rm -f "$DIR/munge/munged.pid"
    case "$DIR" in /tmp/*) rm -rf "$DIR" ;; *) echo "slurm_localhost: left $DIR in place (not under /tmp)" >&2 ;; esac
}

# Slurm client commands that submitit, the tests and users call.
SLURM_COMMANDS="srun sbatch salloc squeue scancel scontrol sinfo sacct"

without() {
    [ $# -gt 0 ] || die "usage: $0 without CMD [ARGS...]"
    local ns=(--mount --propagation private)
    [ "$(id -u)" = 0 ] || ns+=(--map-root-user)
    # /dev/null bound over each command: it stays listed but is not executable, so `which` and shutil.which
    # no longer find it. The mounts live and die with the namespace; the host is untouched.
    exec env -u SLURM_CONF unshare "${ns[@]}" -- bash -c '
        set -euo pipefail
        for tool in $0; do
            while read -r path; do
                [ -n "$path" ] && mount --bind /dev/null "$path"
            done < <(type -ap "$tool" || true)
        done
        exec "$@"' "$SLURM_COMMANDS" "$@"
}

case "$ACTION" in
    without) shift; without "$@" ;;
    up) up ;;
    down) down ;;
    env) [ -f "$DIR/env.sh" ] || die "no cluster in $DIR; run '$0 up $DIR' first"; cat "$DIR/env.sh" ;;
    *) die "usage: $0 up|down|env [DIR] | without CMD [ARGS...]" ;;
esac
