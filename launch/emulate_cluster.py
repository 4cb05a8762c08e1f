"""An emulated multi-node cluster on one machine: real torchrun per node, emulated wires.

    python3 launch/emulate_cluster.py --nodes 2 --procs-per-node 2 --inter-node-mbit 400 \\
        -- launch/bench_allreduce.py -b 64K -e 64M

Each node is a network namespace with its own host name (a UTS namespace), joined to the others
through a bridge that lives in a namespace of its own, so the machine's own network is never
touched. Each node's link to the bridge is shaped with ``tc htb`` in both directions (the node's
uplink, and the bridge's port towards the node for the downlink) to ``--inter-node-mbit``.
Traffic between ranks of one node stays on that namespace's loopback, unshaped.

On every node one real ``torchrun --nnodes N --node-rank k --nproc-per-node M`` starts, with a
c10d rendezvous at node 0's address; torch.distributed and Gloo see nothing but hosts on a
network. Each node's output is streamed with a ``[node k]`` prefix; the exit code is the worst of
the nodes'. When a node fails, the others get 15 s (``--fail-grace``) to finish before they
are stopped. Namespaces, links and per-namespace ``/etc/netns`` files are always removed, on
success, failure, Ctrl-C, SIGTERM or ``--timeout``; ``--cleanup`` removes what a killed run
(SIGKILL) left behind.

Latency: this kernel has no ``netem``, and htb only limits rate (its queue adds delay only
under load), so the inter-node link has the rate limit and no added latency. ``--inter-node-latency-ms``
adds a fixed delay with netem where the kernel has it, and otherwise stops with an error before
anything starts rather than silently running without it.

Needs root (network namespaces); without it, says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

PREFIX = "cmx"  # namespace names: cmx<run>-sw (the bridge), cmx<run>-n<k> (node k)
SUBNET = "10.77.0"
RDZV_PORT = 29400
FAIL_GRACE_S = 15.0  # --fail-grace's default
NETNS_ETC = Path("/etc/netns")
# Per-namespace TCP settings of a cluster network: no slow start after idle (collectives leave a
# connection idle between steps and must not ramp up again each time), and no autocorking (the
# kernel holds a small write back while the connection's earlier packets wait in a queue, and
# behind the shaped link they wait long: with it, our ring all-reduce of 256 KB on 2x2 ranks at
# 400 Mbit/s took 27 ms at the median against 9 ms without, and Gloo's all-to-all of 256 KB
# 16 ms against 6 ms).
SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0", "net.ipv4.tcp_autocorking": "0"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _netns_exec(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], check=check, capture_output=True, text=True)


class Cluster:
    """The namespaces, links and shaping of one emulated cluster; ``remove()`` undoes all of it."""

    def __init__(self, nodes: int, mbit: float, latency_ms: float | None, run_id: str) -> None:
        self.nodes = nodes
        self.mbit = mbit
        self.latency_ms = latency_ms
        self.run = run_id
        self.switch = f"{PREFIX}{run_id}-sw"
        self.names = [f"{PREFIX}{run_id}-n{k}" for k in range(nodes)]
        self.hosts = [f"emu-node{k}" for k in range(nodes)]
        self.addrs = [f"{SUBNET}.{k + 1}" for k in range(nodes)]
        self.created: list[str] = []

    def _shape(self, ns: str, dev: str) -> None:
        """Rate-limit ``dev``'s egress with htb; small packets (TCP ACKs) go ahead of bulk data.

        Two-way traffic on one TCP connection (a Gloo exchange) gets less than the link rate: a
        connection's ACKs share the egress with the other direction's data. Measured at 400
        Mbit/s (50 MB/s): one-way 46 MB/s; a raw-socket exchange 37 MB/s each way; a Gloo 16 MB
        exchange 23-45 MB/s from run to run behind a tbf FIFO, and a steady 23 MB/s (5 runs of 6)
        with this priority class for packets under 128 bytes. This kernel has no fair-queueing
        qdisc (fq_codel, sfq) to do better; the cost model calibrates one-way and exchange rates
        separately for this reason.
        """
        rate = f"{self.mbit}mbit"
        tc = ["tc"]
        _netns_exec(ns, *tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20", "r2q", "1000")
        _netns_exec(ns, *tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate)
        _netns_exec(ns, *tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb",
                    "rate", f"{self.mbit / 10}mbit", "ceil", rate, "prio", "0")
        _netns_exec(ns, *tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb",
                    "rate", f"{self.mbit * 0.9}mbit", "ceil", rate, "prio", "1")
        for leaf in ("10", "20"):
            child = ["netem", "delay", f"{self.latency_ms}ms"] if self.latency_ms else ["pfifo", "limit", "1000"]
            _netns_exec(ns, *tc, "qdisc", "add", "dev", dev, "parent", f"1:{leaf}", "handle", f"{leaf}:", *child)
        # IPv4 total length (bytes 2-3 of the header) below 128: ACKs and other control packets.
        _netns_exec(ns, *tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                    "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10")

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        self.created.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addrs, self.hosts))
        for k, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self.created.append(ns)
            # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts, so every node
            # resolves every other node's host name to its address.
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{k}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{k}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{k}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[k]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            for key, value in SYSCTLS.items():
                _netns_exec(ns, "sysctl", "-q", "-w", f"{key}={value}", check=False)
            self._shape(ns, "eth0")           # node -> bridge (uplink)
            self._shape(self.switch, f"p{k}")  # bridge -> node (downlink)

    def remove(self) -> None:
        for ns in reversed(self.created):
            _kill_namespace(ns)
        self.created.clear()


def _kill_namespace(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)  # also removes the veth pairs inside it
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def stale_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def netem_available() -> bool:
    ns = f"{PREFIX}probe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", ns)
        r = _netns_exec(ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
        return r.returncode == 0
    finally:
        _kill_namespace(ns)


def _stream(proc: subprocess.Popen[bytes], label: str, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace")
        with lock:
            sys.stdout.write(f"[{label}] {line}")
            sys.stdout.flush()


def node_command(cluster: Cluster, k: int, procs: int, script: list[str], rdzv_id: str) -> list[str]:
    """The command node ``k`` runs: its own host name, then torchrun with a c10d rendezvous."""
    torchrun = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(cluster.nodes), "--node-rank", str(k), "--nproc-per-node", str(procs),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addrs[0]}:{RDZV_PORT}",
        "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={1 if k == 0 else 0}",
        "--max-restarts", "0", "--local-addr", cluster.addrs[k], *script,
    ]
    # unshare --uts gives the node its own host name, which is how ranks tell nodes apart.
    inner = f"hostname {cluster.hosts[k]} && exec " + " ".join(_quote(a) for a in torchrun)
    return ["ip", "netns", "exec", cluster.names[k], "unshare", "--uts", "sh", "-c", inner]


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch/emulate_cluster.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--procs-per-node", type=int, default=2)
    p.add_argument("--inter-node-mbit", type=float, default=400.0, help="rate of each node's uplink and downlink")
    p.add_argument("--inter-node-latency-ms", type=float, default=None,
                   help="added one-way delay; needs netem, which this kernel may lack (then: error)")
    p.add_argument("--timeout", type=float, default=1800.0, help="kill every node after this many seconds")
    p.add_argument("--fail-grace", type=float, default=FAIL_GRACE_S,
                   help="after a node fails, stop the others this many seconds later (they may be waiting on it)")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces a killed run left behind, then exit")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... (what torchrun runs on every rank)")
    args = p.parse_args(argv)

    if os.geteuid() != 0:
        print("emulate_cluster: network namespaces need root; rerun as root (or prefix sudo)", file=sys.stderr)
        return 2
    if shutil.which("ip") is None or shutil.which("tc") is None or shutil.which("unshare") is None:
        print("emulate_cluster: needs iproute2 (ip, tc) and util-linux (unshare) on PATH", file=sys.stderr)
        return 2
    if args.cleanup:
        for ns in stale_namespaces():
            _kill_namespace(ns)
            print(f"removed {ns}")
        return 0
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        p.error("give the script to run after --, e.g. -- launch/bench_allreduce.py -b 1K -e 1M")
    if args.nodes < 1 or args.nodes > 200:
        p.error(f"--nodes must be 1..200, got {args.nodes}")
    if args.procs_per_node < 1:
        p.error(f"--procs-per-node must be >= 1, got {args.procs_per_node}")
    if args.inter_node_mbit <= 0:
        p.error(f"--inter-node-mbit must be > 0, got {args.inter_node_mbit}")
    if args.inter_node_latency_ms and not netem_available():
        print("emulate_cluster: --inter-node-latency-ms needs the netem qdisc, which this kernel lacks; "
              "leave the option out (links are then rate-limited with no added delay)", file=sys.stderr)
        return 2

    run_id = uuid.uuid4().hex[:6]
    cluster = Cluster(args.nodes, args.inter_node_mbit, args.inter_node_latency_ms, run_id)
    procs: list[subprocess.Popen[bytes]] = []

    def _terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    lock = threading.Lock()
    worst = 0
    try:
        cluster.create()
        print(f"emulate_cluster: {args.nodes} node(s) x {args.procs_per_node} proc(s), inter-node "
              f"{args.inter_node_mbit:g} Mbit/s each way, no added latency" if not args.inter_node_latency_ms else
              f"emulate_cluster: {args.nodes} node(s) x {args.procs_per_node} proc(s), inter-node "
              f"{args.inter_node_mbit:g} Mbit/s, {args.inter_node_latency_ms} ms delay", flush=True)
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="eth0", TP_SOCKET_IFNAME="eth0",
                   PYTHONUNBUFFERED="1")
        threads = []
        for k in range(args.nodes):
            proc = subprocess.Popen(node_command(cluster, k, args.procs_per_node, script, run_id), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(proc)
            t = threading.Thread(target=_stream, args=(proc, f"node {k}", lock), daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + args.timeout
        # A node that fails leaves the others waiting on a rendezvous that cannot complete: after
        # the first failure the rest get --fail-grace seconds to finish, then they are stopped.
        stop_at = deadline
        codes: dict[int, int] = {}
        while len(codes) < len(procs):
            for k, proc in enumerate(procs):
                if k in codes or proc.poll() is None:
                    continue
                codes[k] = proc.returncode
                if proc.returncode != 0:
                    print(f"emulate_cluster: node {k} exited with {proc.returncode}", file=sys.stderr, flush=True)
                    worst = max(worst, proc.returncode if proc.returncode > 0 else 128 - proc.returncode)
                    stop_at = min(stop_at, time.monotonic() + args.fail_grace)
            now = time.monotonic()
            if len(codes) < len(procs) and now >= stop_at:
                running = [j for j in range(len(procs)) if j not in codes]
                if now >= deadline:
                    print(f"emulate_cluster: timeout after {args.timeout:g} s; node(s) still running: {running}",
                          file=sys.stderr, flush=True)
                    worst = 124
                else:
                    print(f"emulate_cluster: stopping node(s) {running} {args.fail_grace:g} s after a node failed",
                          file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=5)
    except KeyboardInterrupt as exc:
        print(f"emulate_cluster: interrupted ({exc or 'Ctrl-C'}); stopping every node", file=sys.stderr, flush=True)
        worst = 130
    except subprocess.CalledProcessError as exc:
        print(f"emulate_cluster: setting up the network failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}",
              file=sys.stderr, flush=True)
        worst = 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        cluster.remove()
        for s, h in old.items():
            signal.signal(s, h)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
