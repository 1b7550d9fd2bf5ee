#!/usr/bin/env bash
# local-mesh.sh: an N-node meshnode mesh on one Linux host, each node in a
# network namespace of its own, so that the nodes talk over real (virtual)
# links rather than loopback.
#
# Usage (as root: namespaces, links and qdiscs need CAP_NET_ADMIN):
#
#   deploy/local-mesh.sh up N [options] [-- extra node flags]
#   deploy/local-mesh.sh status
#   deploy/local-mesh.sh down [--purge]
#   deploy/local-mesh.sh --help
#
# up N     starts N nodes (N >= 1). Node 1 runs `meshnode serve --split`
#          with the model; nodes 2..N run `meshnode join` with the address
#          and mesh key node 1 prints, and fetch their layers from it. up
#          first takes down whatever this script left running (same
#          prefix), so it is safe to re-run; data dirs (peer keys, mesh
#          key, slices) are kept between runs. It returns once every node
#          serves (has a complete pipeline).
# status   prints each node's /api/status in short.
# down     kills the nodes and deletes the namespaces, links and bridge;
#          safe to run when nothing is up. --purge also deletes the state
#          directory (data dirs, logs, API key).
#
# Options of up:
#   --delay D        delay on every node's link, e.g. 1ms: a netem qdisc
#                    where the kernel has sch_netem; else a userspace delay
#                    relay (needs nft and python3): in every namespace an
#                    nftables rule sends the node's libp2p connections
#                    (port 4001: stages and weights; gossip and HTTP are not
#                    delayed) to a relay on the bridge, which forwards every
#                    chunk D after it read it, each way
#   --rate R         tbf rate limit on every node's link, e.g. 100mbit
#                    (not together with --delay)
#   --model PATH     GGUF for node 1 (default ../shared/models/stories260K.gguf
#                    next to the repository when present, else meshnode's
#                    default model)
#   --bin PATH       meshnode binary (default bin/meshnode of the repository,
#                    built with `make build` when missing)
#   --threads N      --threads of every node (default 1: N nodes share one
#                    host, and ggml's workers busy-wait)
#   --ctx N          --ctx of node 1 (the mesh's context per sequence)
#   --wire-dtype T   --wire-dtype of every node: f16 (default) or f32
#   -- FLAGS...      further flags for every node's command line
#
# Layout: a bridge <prefix>br0 with address <net>.1/24 in the root
# namespace (so the host reaches every node), namespaces <prefix>node1..N,
# each linked to the bridge by a veth pair (<prefix>vI on the bridge, eth0
# inside) with address <net>.(10+I)/24. Every node listens for libp2p on
# <net>.(10+I):4001 and gossip on its default port, and serves its HTTP API
# on <net>.(10+I):9337. That address is not loopback, so the API needs a
# key: up generates one into <dir>/api-key (kept between runs), gives it
# to every node with --api-key-file and prints it; clients send
# "Authorization: Bearer <key>". Logs are <dir>/nodeI.log, data dirs
# <dir>/nodeI, pids <dir>/nodeI.pid. The delay relay, when --delay needs
# it, listens on <net>.1:(41000+I) for node I; its pid is <dir>/relay.pid
# and its log <dir>/relay.log.
#
# Defaults, overridable through the environment (the tests use their own):
#   LOCAL_MESH_PREFIX  mn-                  names of bridge, namespaces, links
#   LOCAL_MESH_NET     10.77.0              first three octets of the /24
#   LOCAL_MESH_DIR     /tmp/meshnode-local  state directory
#   LOCAL_MESH_PORT    9337                 HTTP API port
#
# Example:
#   sudo deploy/local-mesh.sh up 3 --delay 1ms
#   curl -s http://10.77.0.12:9337/v1/completions \
#     -H "Authorization: Bearer $(sudo cat /tmp/meshnode-local/api-key)" \
#     -d '{"model":"stories260K","prompt":"Once upon a time","max_tokens":32,"temperature":0}'
#   sudo deploy/local-mesh.sh down
set -euo pipefail

PREFIX=${LOCAL_MESH_PREFIX:-mn-}
NET=${LOCAL_MESH_NET:-10.77.0}
DIR=${LOCAL_MESH_DIR:-/tmp/meshnode-local}
PORT=${LOCAL_MESH_PORT:-9337}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BRIDGE="${PREFIX}br0"
MESH_KEY="" # set for the joiners only

die() {
	echo "local-mesh: $*" >&2
	exit 1
}
say() { echo "local-mesh: $*" >&2; }

usage() {
	# The header comment above is the manual.
	sed -n '2,/^set -euo pipefail$/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

need_root() {
	[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces and links need CAP_NET_ADMIN)"
	command -v ip >/dev/null || die "needs the ip command (iproute2)"
}

node_addr() { echo "${NET}.$((10 + $1))"; }

# netem_works: whether this kernel has the netem qdisc (tried on a
# throwaway veth pair).
netem_works() {
	local a="${PREFIX}probe0" ok=1
	ip link del "$a" 2>/dev/null || true
	ip link add "$a" type veth peer name "${PREFIX}probe1" 2>/dev/null || return 1
	tc qdisc add dev "$a" root netem delay 1ms 2>/dev/null || ok=0
	ip link del "$a" 2>/dev/null || true
	[ $ok -eq 1 ]
}

# namespaces lists this prefix's node namespaces.
namespaces() {
	ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}node[0-9]+\$" || true
}

# is_meshnode PID: whether PID is still a meshnode process (a stale pid file
# must not kill whatever reuses the number).
is_meshnode() {
	[ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q meshnode
}

# is_relay PID: whether PID is still this script's delay relay.
is_relay() {
	[ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q meshnode-delay-relay
}

# stop_pids PID...: SIGTERM, up to 5 s for a clean exit, then SIGKILL.
stop_pids() {
	local pids=() p
	for p in "$@"; do
		is_meshnode "$p" && pids+=("$p")
	done
	[ ${#pids[@]} -gt 0 ] || return 0
	kill -TERM "${pids[@]}" 2>/dev/null || true
	for _ in $(seq 50); do
		local alive=0
		for p in "${pids[@]}"; do
			kill -0 "$p" 2>/dev/null && alive=1
		done
		[ $alive -eq 0 ] && return 0
		sleep 0.1
	done
	kill -KILL "${pids[@]}" 2>/dev/null || true
}

cmd_down() {
	local purge=0
	for a in "$@"; do
		case $a in
		--purge) purge=1 ;;
		*) die "down: unknown argument $a" ;;
		esac
	done
	need_root
	local pids=() ns f
	# Everything running inside our namespaces (including leftovers of a run
	# whose state directory is gone), and what the pid files name.
	for ns in $(namespaces); do
		for p in $(ip netns pids "$ns" 2>/dev/null); do pids+=("$p"); done
	done
	for f in "$DIR"/node*.pid; do
		[ -f "$f" ] || continue
		pids+=("$(cat "$f")")
	done
	[ ${#pids[@]} -gt 0 ] && stop_pids "${pids[@]}"
	rm -f "$DIR"/node*.pid
	if [ -f "$DIR/relay.pid" ]; then
		local rp
		rp=$(cat "$DIR/relay.pid")
		is_relay "$rp" && kill -TERM "$rp" 2>/dev/null || true
		rm -f "$DIR/relay.pid"
	fi
	for ns in $(namespaces); do
		ip netns del "$ns" 2>/dev/null || true
	done
	# Deleting a namespace deletes its veth ends, and with them the pairs;
	# links left over from a half-built run go here.
	for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^${PREFIX}v[0-9]+n?\$" || true); do
		ip link del "$l" 2>/dev/null || true
	done
	ip link del "$BRIDGE" 2>/dev/null || true
	if [ $purge -eq 1 ]; then
		rm -rf "$DIR"
	fi
	say "down (prefix ${PREFIX})"
}

# wait_log FILE PATTERN PID SECONDS: until FILE has a line matching PATTERN;
# fails when PID exits first or time runs out.
wait_log() {
	local file=$1 pat=$2 pid=$3 secs=$4
	for _ in $(seq $((secs * 10))); do
		grep -qE "$pat" "$file" 2>/dev/null && return 0
		kill -0 "$pid" 2>/dev/null || {
			tail -n 30 "$file" >&2 || true
			die "node (pid $pid) exited; log: $file"
		}
		sleep 0.1
	done
	tail -n 30 "$file" >&2 || true
	die "timed out after ${secs}s waiting for /$pat/ in $file"
}

# start_node I ARGS...: runs meshnode ARGS in namespace I, detached, logging
# to DIR/nodeI.log. Secrets stay off the command line (where ps shows
# them): the API key in its file, the mesh key in the environment.
start_node() {
	local i=$1
	shift
	local ns="${PREFIX}node$i" log="$DIR/node$i.log"
	: >"$log"
	# The subshell, setsid and ip netns exec all exec, so $! is meshnode's
	# own pid.
	(
		[ -n "$MESH_KEY" ] && export MESHNODE_MESH_KEY="$MESH_KEY"
		exec setsid ip netns exec "$ns" "$BIN" "$@" --api-key-file "$DIR/api-key" >"$log" 2>&1 </dev/null
	) &
	echo $! >"$DIR/node$i.pid"
}

# The delay relay: one listener per node on the bridge's address, each
# forwarding to that node's libp2p port; every chunk read is written on
# DELAY seconds later, in both directions, without slowing the rate.
relay_py() {
	cat <<'PY'
import asyncio, sys, time

delay = float(sys.argv[1])
host = sys.argv[2]
routes = [a.split("=") for a in sys.argv[3:]]  # PORT=DSTHOST:DSTPORT


async def pump(reader, writer):
    q = asyncio.Queue()

    async def read():
        while True:
            data = await reader.read(65536)
            q.put_nowait((time.monotonic() + delay, data))
            if not data:
                return

    async def write():
        while True:
            due, data = await q.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(read(), write())


async def serve(dst, reader, writer):
    dhost, dport = dst.rsplit(":", 1)
    try:
        r2, w2 = await asyncio.open_connection(dhost, int(dport))
    except OSError as e:
        print("meshnode-delay-relay: %s: %s" % (dst, e), flush=True)
        writer.close()
        return
    print("meshnode-delay-relay: %s -> %s" % (writer.get_extra_info("peername")[0], dst), flush=True)
    try:
        await asyncio.gather(pump(reader, w2), pump(r2, writer))
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
        w2.close()


async def main():
    servers = []
    for port, dst in routes:
        cb = lambda r, w, dst=dst: serve(dst, r, w)
        servers.append(await asyncio.start_server(cb, host, int(port)))
    print("meshnode-delay-relay: %d routes, %.6f s each way" % (len(routes), delay), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


asyncio.run(main())
PY
}

# seconds D: a tc-style duration (500us, 1ms, 0.2s, 2) in seconds.
seconds() {
	local d=$1
	case $d in
	*us) awk -v v="${d%us}" 'BEGIN { printf "%.6f", v / 1e6 }' ;;
	*ms) awk -v v="${d%ms}" 'BEGIN { printf "%.6f", v / 1e3 }' ;;
	*s) awk -v v="${d%s}" 'BEGIN { printf "%.6f", v }' ;;
	*) awk -v v="$d" 'BEGIN { printf "%.6f", v }' ;;
	esac
}

# start_relay N DELAY: the delay relay for nodes 1..N, and in each node's
# namespace the nftables rules that send its libp2p connections to the
# other nodes through it.
start_relay() {
	local n=$1 delay=$2 i j routes=()
	command -v nft >/dev/null || die "--delay: no netem in this kernel, and no nft for the delay relay (apt-get install nftables)"
	command -v python3 >/dev/null || die "--delay: no netem in this kernel, and no python3 for the delay relay"
	local secs
	secs=$(seconds "$delay")
	[[ $secs =~ ^[0-9.]+$ ]] || die "--delay $delay: not a duration"
	for i in $(seq "$n"); do
		routes+=("$((41000 + i))=$(node_addr "$i"):4001")
	done
	relay_py >"$DIR/meshnode-delay-relay.py"
	(exec setsid python3 "$DIR/meshnode-delay-relay.py" "$secs" "${NET}.1" "${routes[@]}" >"$DIR/relay.log" 2>&1 </dev/null) &
	echo $! >"$DIR/relay.pid"
	for _ in $(seq 50); do
		grep -q '^meshnode-delay-relay:' "$DIR/relay.log" 2>/dev/null && break
		kill -0 "$(cat "$DIR/relay.pid")" 2>/dev/null || { cat "$DIR/relay.log" >&2; die "the delay relay exited"; }
		sleep 0.1
	done
	grep -q '^meshnode-delay-relay:' "$DIR/relay.log" || die "the delay relay did not start; log: $DIR/relay.log"
	for i in $(seq "$n"); do
		{
			echo "table ip meshnode_delay {"
			echo " chain out {"
			echo "  type nat hook output priority -100; policy accept;"
			for j in $(seq "$n"); do
				[ "$i" -eq "$j" ] && continue
				echo "  ip daddr $(node_addr "$j") tcp dport 4001 dnat to ${NET}.1:$((41000 + j))"
			done
			echo " }"
			echo " chain post {"
			echo "  type nat hook postrouting priority 100; policy accept;"
			echo " }"
			echo "}"
		} | ip netns exec "${PREFIX}node$i" nft -f - || die "nft in ${PREFIX}node$i failed"
	done
	say "no netem in this kernel: libp2p traffic between nodes goes through a delay relay ($delay each way; log $DIR/relay.log)"
}

cmd_up() {
	[ $# -ge 1 ] || die "up: how many nodes? (up N)"
	local n=$1
	shift
	[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "up: N must be 1..200, not $n"
	local delay="" rate="" model="" threads=1 ctx="" wire=""
	BIN=""
	local extra=()
	while [ $# -gt 0 ]; do
		case $1 in
		--delay) delay=${2:?--delay needs a value}; shift 2 ;;
		--rate) rate=${2:?--rate needs a value}; shift 2 ;;
		--model) model=${2:?--model needs a path}; shift 2 ;;
		--bin) BIN=${2:?--bin needs a path}; shift 2 ;;
		--threads) threads=${2:?--threads needs a value}; shift 2 ;;
		--ctx) ctx=${2:?--ctx needs a value}; shift 2 ;;
		--wire-dtype) wire=${2:?--wire-dtype needs a value}; shift 2 ;;
		--) shift; extra=("$@"); break ;;
		*) die "up: unknown option $1 (see --help)" ;;
		esac
	done
	[ -n "$delay" ] && [ -n "$rate" ] && die "up: --delay and --rate do not go together"
	need_root

	if [ -z "$BIN" ]; then
		BIN="$REPO/bin/meshnode"
		[ -x "$BIN" ] || make -C "$REPO" build >&2
	fi
	BIN=$(realpath "$BIN")
	[ -x "$BIN" ] || die "no meshnode binary at $BIN"
	if [ -z "$model" ] && [ -f "$REPO/../shared/models/stories260K.gguf" ]; then
		model="$REPO/../shared/models/stories260K.gguf"
	fi
	if [ -n "$model" ]; then
		[ -f "$model" ] || die "no model file $model"
		model=$(realpath "$model")
	fi

	cmd_down >/dev/null 2>&1 || true
	# A failed up leaves nothing half-built behind (the logs stay).
	trap 'rc=$?; if [ $rc -ne 0 ]; then say "up failed; taking down what it started (logs stay in $DIR)"; cmd_down >/dev/null 2>&1 || true; fi' EXIT
	mkdir -p "$DIR"
	chmod 700 "$DIR"
	if [ ! -s "$DIR/api-key" ]; then
		(umask 077 && head -c 24 /dev/urandom | base64 | tr '+/' '-_' >"$DIR/api-key")
	fi
	API_KEY=$(cat "$DIR/api-key")

	# The network. Without netem, --delay is a userspace relay.
	local relay=0
	if [ -n "$delay" ] && ! netem_works; then
		relay=1
	fi
	ip link add "$BRIDGE" type bridge
	ip addr add "${NET}.1/24" dev "$BRIDGE"
	ip link set "$BRIDGE" up
	local i ns host peer
	for i in $(seq "$n"); do
		ns="${PREFIX}node$i" host="${PREFIX}v$i" peer="${PREFIX}v${i}n"
		ip netns add "$ns"
		ip link add "$host" type veth peer name "$peer"
		ip link set "$peer" netns "$ns"
		ip link set "$host" master "$BRIDGE" up
		ip -n "$ns" link set lo up
		ip -n "$ns" link set "$peer" name eth0
		ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
		ip -n "$ns" link set eth0 up
		if [ -n "$delay" ] && [ $relay -eq 0 ]; then
			tc qdisc add dev "$host" root netem delay "$delay" ||
				die "tc netem failed on $host"
		fi
		if [ -n "$rate" ]; then
			tc qdisc add dev "$host" root tbf rate "$rate" burst 256kb latency 50ms ||
				die "tc tbf failed on $host"
		fi
	done

	[ $relay -eq 1 ] && start_relay "$n" "$delay"

	# The nodes. Every flag is explicit, so MESHNODE_* variables of the
	# caller's environment change nothing but what they name.
	local common=()
	[ -n "$threads" ] && common+=(--threads "$threads")
	[ -n "$wire" ] && common+=(--wire-dtype "$wire")
	local addr
	addr=$(node_addr 1)
	local serve=(serve --split --data-dir "$DIR/node1" --http "$addr:$PORT" --listen "/ip4/$addr/tcp/4001")
	[ -n "$model" ] && serve+=(--model "$model")
	[ -n "$ctx" ] && serve+=(--ctx "$ctx")
	start_node 1 "${serve[@]}" "${common[@]}" "${extra[@]}"
	local pid1
	pid1=$(cat "$DIR/node1.pid")
	wait_log "$DIR/node1.log" 'meshnode join /ip4/' "$pid1" 120
	local join key
	join=$(grep -oE 'meshnode join /ip4/[^ ]+' "$DIR/node1.log" | head -n 1 | cut -d' ' -f3)
	key=$(grep -oE -- '--mesh-key mk1_[A-Za-z0-9_-]+' "$DIR/node1.log" | head -n 1 | cut -d' ' -f2)
	[ -n "$join" ] && [ -n "$key" ] || die "no join command in $DIR/node1.log"
	for i in $(seq 2 "$n"); do
		addr=$(node_addr "$i")
		MESH_KEY=$key start_node "$i" join "$join" --data-dir "$DIR/node$i" \
			--http "$addr:$PORT" --listen "/ip4/$addr/tcp/4001" "${common[@]}" "${extra[@]}"
	done
	# Ready means the node has a complete pipeline; a joiner gets one only
	# once the plan's stages are all loaded, so start them all, then wait.
	for i in $(seq "$n"); do
		wait_log "$DIR/node$i.log" 'meshnode is serving on' "$(cat "$DIR/node$i.pid")" 120
	done

	trap - EXIT
	echo "mesh of $n nodes is up (prefix ${PREFIX}, state in $DIR)"
	echo "API key: $API_KEY"
	for i in $(seq "$n"); do
		echo "  node$i: http://$(node_addr "$i"):$PORT/v1   log $DIR/node$i.log"
	done
	echo
	cmd_status
}

cmd_status() {
	need_root
	command -v curl >/dev/null || die "status needs curl"
	[ -s "$DIR/api-key" ] || die "no $DIR/api-key: is the mesh up?"
	local key i any=0
	key=$(cat "$DIR/api-key")
	for f in "$DIR"/node*.pid; do
		[ -f "$f" ] || continue
		any=1
		i=$(basename "$f" .pid)
		i=${i#node}
		local url="http://$(node_addr "$i"):$PORT/api/status" body
		if ! body=$(curl -sf --max-time 5 -H "Authorization: Bearer $key" "$url"); then
			echo "node$i: no answer from $url (pid $(cat "$f"), log $DIR/node$i.log)"
			continue
		fi
		if command -v jq >/dev/null; then
			jq -r --arg n "node$i" '
				def short: .[-6:];
				"\($n): peer \(.self | short) ready=\(.ready) " +
				(if .local then "layers [\(.local.start),\(.local.end)) weights \(.local.weight_bytes) B fetched \(.local.fetched_bytes) B" else "no layers" end) +
				"\n  plan: " + ([.plan[] | "\(.node | short) [\(.start),\(.end))"] | join(" -> ")) +
				"\n  members: " + ([.nodes[] | "\(.peer_id | short)=\(.state)"] | join(" "))' <<<"$body"
		else
			echo "node$i:"
			echo "$body"
		fi
	done
	[ $any -eq 1 ] || echo "no nodes (prefix ${PREFIX}, state in $DIR)"
}

case ${1:-} in
up) shift; cmd_up "$@" ;;
down) shift; cmd_down "$@" ;;
status) shift; cmd_status "$@" ;;
-h | --help | help) usage ;;
*)
	usage >&2
	exit 2
	;;
esac
