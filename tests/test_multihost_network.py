"""bcp's gloo group across hosts whose name resolves to loopback (Debian's 127.0.1.1).

Two hosts are simulated with network namespaces joined by a veth pair (addresses in
10.231.77.0/24, which exist only inside the namespaces the test creates); each has
its own /etc/hosts (``ip netns exec`` mounts /etc/netns/<name>/hosts over it) that
maps this machine's host name to 127.0.1.1. Two ranks run in each, forked by a server
started once per host for the whole module (tests/multihost_server.py: it imports torch
and bcp once, so a rank starts in a fraction of a second). Needs root and ``ip netns``;
skipped otherwise."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

SERVER = pathlib.Path(__file__).with_name("multihost_server.py")
SUBNET = "10.231.77"
RANKS_PER_HOST = 2


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class Rank:
    """One rank forked by a host's server (``multihost_server.py``): its pid, output file, exit status."""

    def __init__(self, pid: int, out: pathlib.Path) -> None:
        self.pid, self.out, self.returncode = pid, out, None

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # the rank is its own session: killed whole
            except ProcessLookupError:
                pass


class Server:
    """``python multihost_server.py`` started in a host's namespace: imports torch and bcp once, forks ranks."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.ranks: dict[int, Rank] = {}
        self.started: list[int] = []  # pids, in the order of the requests
        self.early: dict[int, int] = {}  # exit statuses read before their rank was registered
        self.lock = threading.Condition()
        self.ended = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            with self.lock:
                if "pid" in message:
                    self.started.append(message["pid"])
                elif message["exited"] in self.ranks:
                    self.ranks[message["exited"]].returncode = message["rc"]
                else:
                    self.early[message["exited"]] = message["rc"]
                self.lock.notify_all()
        with self.lock:
            self.ended = True
            self.lock.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], out: pathlib.Path, timeout: float = 120) -> Rank:
        with self.lock:
            count = len(self.started)
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"argv": argv, "env": env, "out": str(out)}) + "\n")
            self.process.stdin.flush()
            if not self.lock.wait_for(lambda: len(self.started) > count or self.ended, timeout):
                raise RuntimeError(f"the host's fork server did not answer in {timeout:g} s")
            if self.ended:
                raise RuntimeError(f"the host's fork server ended (exit {self.process.wait()})")
            rank = Rank(self.started[count], out)
            rank.returncode = self.early.pop(rank.pid, None)
            self.ranks[rank.pid] = rank
            return rank

    def wait(self, rank: Rank, timeout: float) -> bool:
        """True once ``rank`` has exited, False if it still runs after ``timeout`` s."""
        with self.lock:
            return self.lock.wait_for(lambda: rank.returncode is not None or self.ended, timeout) and (
                rank.returncode is not None
            )

    def close(self) -> None:
        for rank in list(self.ranks.values()):
            rank.kill()
        if self.process.poll() is None:
            assert self.process.stdin is not None
            try:
                self.process.stdin.close()  # end of requests: the server kills what runs and exits
            except BrokenPipeError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)


class Hosts:
    """Two namespaces ``bcp-<pid>-a`` and ``-b`` linked by a veth pair, each with a fork server
    (shared by every case of this module); removed by ``close``."""

    def __init__(self) -> None:
        tag = f"{os.getpid()}{int(time.monotonic_ns()) % 1000:03d}"
        self.names = [f"bcp-{tag}-a", f"bcp-{tag}-b"]
        self.links = [f"bcpv{tag}a"[:15], f"bcpv{tag}b"[:15]]
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.servers: list[Server] = []

    def open(self) -> None:
        for name in self.names:
            self._run("netns", "add", name)
            hosts = pathlib.Path("/etc/netns", name)
            hosts.mkdir(parents=True, exist_ok=True)
            (hosts / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        self._run("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for name, link, address in zip(self.names, self.links, self.addresses, strict=True):
            self._run("link", "set", link, "netns", name)
            self._run("-n", name, "addr", "add", f"{address}/24", "dev", link)
            self._run("-n", name, "link", "set", link, "up")
            self._run("-n", name, "link", "set", "lo", "up")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "BCP_", "MASTER_"))}
        env["PYTHONUNBUFFERED"] = "1"
        for name in self.names:
            process = subprocess.Popen(
                ["ip", "netns", "exec", name, sys.executable, str(SERVER)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: killed whole if it will not end
            )
            self.servers.append(Server(process))

    def _run(self, *args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def exec(self, host: int, argv: list[str], env: dict[str, str], out: pathlib.Path) -> Rank:
        """Fork one rank of ``multihost_jobs.py ARGV`` on ``host``, as if started anew with ``env``."""
        return self.servers[host].fork(argv, env, out)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        for name in self.names:
            _ip("netns", "del", name)  # the veth pair goes with its namespaces
            shutil.rmtree(pathlib.Path("/etc/netns", name), ignore_errors=True)


def _usable() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"bcp-probe-{os.getpid()}"
    if _ip("netns", "add", probe).returncode != 0:
        return "ip netns add is not permitted here"
    _ip("netns", "del", probe)
    return None


@pytest.fixture(scope="module")
def hosts():
    """The two hosts and their fork servers, made once for the module (starting a server
    imports torch: seconds) and removed at its end, failures included."""
    reason = _usable()
    if reason:
        pytest.skip(reason)
    pair = Hosts()
    try:
        pair.open()
        yield pair
    finally:
        pair.close()
    assert not set(pair.names) & set(_ip("netns", "list").stdout.split()), "namespaces left behind"


_PORTS = itertools.count(29477)  # a fresh port per case: the hosts (and the last case's sockets) live on


def _run_job(hosts: Hosts, case: str, uri: str, extra_env: dict[str, str], deadline: float) -> list[dict]:
    """Start 2 hosts x 2 ranks, wait for every process (at most ``deadline`` s), return their reports by rank."""
    world = 2 * RANKS_PER_HOST
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "BCP_", "MASTER_"))}
    env.update(MASTER_ADDR=hosts.addresses[0], MASTER_PORT=str(next(_PORTS)), PYTHONUNBUFFERED="1", **extra_env)
    env.setdefault("JOB_DUMP_AFTER", str(deadline - 5))
    started = time.monotonic()
    ranks = []
    outputs_dir = pathlib.Path(uri).parent
    try:
        for rank in range(world):
            host = rank // RANKS_PER_HOST
            argv = [case, str(rank), str(world), hosts.links[host], uri]
            ranks.append((host, hosts.exec(host, argv, env, outputs_dir / f"rank{rank}.out")))
        reports = []
        for rank, (host, process) in enumerate(ranks):
            if not hosts.servers[host].wait(process, max(1.0, deadline - (time.monotonic() - started))):
                pytest.fail(f"rank {rank} still running after {deadline:g} s (the job hangs)")
            out = process.out.read_text(errors="replace")
            if "Timeout (" in out:  # faulthandler's dump: the job hung
                pytest.fail(f"rank {rank} hung (exit {process.returncode}); its threads:\n{out[-6000:]}")
            lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
            assert lines, f"rank {rank} (exit {process.returncode}) reported nothing:\n{out[-3000:]}"
            reports.append(json.loads(lines[-1][len("REPORT ") :]))
        return reports
    finally:
        for _, process in ranks:
            process.kill()  # a failed case leaves nothing running into the next one


def test_auto_choice_saves_and_loads_exactly_when_the_host_name_is_loopback(hosts, tmp_path):
    reports = _run_job(hosts, "auto", str(tmp_path / "ck"), {}, deadline=120)
    for r, report in enumerate(reports):
        assert report["ok"], f"rank {r}: {report.get('error_type')}: {report.get('message')}"
        assert report["exact"], f"rank {r} loaded other values"
        assert report["elapsed_s"] < 30, f"rank {r}: save + load took {report['elapsed_s']:.1f} s"
        assert report["env_after"] is None, "GLOO_SOCKET_IFNAME must be restored (absent) after the group is made"
        link = hosts.links[r // RANKS_PER_HOST]
        chosen = [line for line in report["log"] if f"listens on {link}" in line]
        assert chosen and "127.0.1.1" in chosen[0] and "loopback" in chosen[0], report["log"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "env"),
    [("wrong-ifname", {}), ("auto-off", {"BCP_GLOO_AUTO_IFNAME": "0"})],
    ids=["GLOO_SOCKET_IFNAME=lo", "BCP_GLOO_AUTO_IFNAME=0"],
)
def test_unreachable_gloo_addresses_fail_within_the_bound_naming_the_setting(hosts, tmp_path, case, env):
    bound = 3  # every rank has arrived: no connect can succeed, so the test only waits for the bound
    started = time.monotonic()
    reports = _run_job(
        hosts, case, str(tmp_path / "ck"), {"BCP_GLOO_CONNECT_TIMEOUT": str(bound), **env}, deadline=bound + 60
    )
    total = time.monotonic() - started
    for r, report in enumerate(reports):
        assert not report["ok"], f"rank {r} saved although no rank can reach another host's gloo address"
        assert report["error_type"] == "GroupConnectError", report
        assert "GLOO_SOCKET_IFNAME" in report["message"], report["message"]
        assert report["elapsed_s"] < bound + 5, f"rank {r} took {report['elapsed_s']:.1f} s to fail"
        expected = "lo" if case == "wrong-ifname" else None
        assert report["env_after"] == expected, "the environment is as the job left it"
    assert any("BCP_GLOO_CONNECT_TIMEOUT" in r["message"] for r in reports), "some rank waited: the bound is named"
    assert total < bound + 60


@pytest.mark.slow
def test_a_late_rank_is_waited_for_the_bound_counts_once_every_rank_arrived(hosts, tmp_path):
    bound, late = 3, 5  # the early ranks wait past the bound (late - 1 > bound) and still connect
    env = {"BCP_GLOO_CONNECT_TIMEOUT": str(bound), "LATE_RANK_SLEEP": str(late)}
    reports = _run_job(hosts, "late", str(tmp_path / "ck"), env, deadline=120)
    for r, report in enumerate(reports):
        assert report["ok"], f"rank {r}: {report.get('error_type')}: {report.get('message')}"
        assert report["exact"]
    assert min(r["elapsed_s"] for r in reports[:-1]) > late - 1, "the early ranks waited for the late one"


# -- the choice and the watchdog, in one process (no namespaces needed) -----------------


def _fake_host(monkeypatch, *, default: str, addresses: list[tuple[str, str]], route: str | None) -> None:
    from bcp.coordination import gloo_network

    monkeypatch.setattr(gloo_network, "interface_addresses", lambda: addresses)
    monkeypatch.setattr(gloo_network, "gloo_default_address", lambda: (default, f"the host name resolves to {default}"))
    monkeypatch.setattr(gloo_network, "route_source", lambda address: route)


ETH = [("lo", "127.0.0.1"), ("eth0", "10.0.0.5"), ("docker0", "172.17.0.1")]


@pytest.mark.parametrize(
    ("env", "default", "route", "expected"),
    [
        ({"MASTER_ADDR": "10.0.0.1"}, "127.0.1.1", "10.0.0.5", "eth0"),  # Debian's host name
        ({"MASTER_ADDR": "10.0.0.1"}, "127.0.0.1", "10.0.0.5", "eth0"),  # gloo's fallback
        ({"MASTER_ADDR": "10.0.0.1"}, "172.17.0.1", "10.0.0.5", "eth0"),  # a docker bridge
        ({"MASTER_ADDR": "10.0.0.1"}, "10.0.0.5", "10.0.0.5", None),  # already right: left alone
        ({"MASTER_ADDR": "10.0.0.1", "GLOO_SOCKET_IFNAME": "docker0"}, "127.0.1.1", "10.0.0.5", None),  # the user's
        ({"MASTER_ADDR": "10.0.0.1", "BCP_GLOO_AUTO_IFNAME": "0"}, "127.0.1.1", "10.0.0.5", None),  # turned off
        ({}, "127.0.1.1", "10.0.0.5", None),  # no master known
        ({"MASTER_ADDR": "127.0.0.1"}, "127.0.1.1", "127.0.0.1", None),  # a single host
        ({"MASTER_ADDR": "10.0.0.1"}, "127.0.1.1", None, None),  # no route to the master
        ({"MASTER_ADDR": "10.0.0.1"}, "127.0.1.1", "10.9.9.9", None),  # a route from no known interface
    ],
)
def test_the_interface_chosen(monkeypatch, env, default, route, expected):
    from bcp.coordination import gloo_network

    _fake_host(monkeypatch, default=default, addresses=ETH, route=route)
    choice = gloo_network.choose(env)
    assert choice.interface == expected, choice
    if expected is not None:
        assert choice.address == route and "MASTER_ADDR" in choice.reason and default in choice.reason
    elif "GLOO_SOCKET_IFNAME" in env:
        assert choice.address == "172.17.0.1" and "set by the user" in choice.reason
    else:
        assert choice.address == default


def test_interface_addresses_are_the_ones_psutil_lists():
    psutil = pytest.importorskip("psutil")
    from bcp.coordination import gloo_network

    if sys.platform != "linux":
        pytest.skip("read from Linux ioctls and /proc")
    ours = {(name, address) for name, address in gloo_network.interface_addresses()}
    theirs = {
        (name, a.address.split("%")[0])
        for name, entries in psutil.net_if_addrs().items()
        for a in entries
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }
    assert ours == theirs
    assert gloo_network.interface_of("127.0.0.1") == "lo"
    assert gloo_network.route_source("127.0.0.1") == "127.0.0.1"


def test_the_environment_is_restored_even_when_creation_fails(monkeypatch):
    from bcp.coordination import gloo_network

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    seen = []

    def create():
        seen.append(os.environ.get("GLOO_SOCKET_IFNAME"))
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"), gloo_network._environment("GLOO_SOCKET_IFNAME", "eth7"):
        create()
    assert seen == ["eth7"] and "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    with gloo_network._environment("GLOO_SOCKET_IFNAME", "eth7"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


def test_the_watchdog_raises_in_the_caller_and_later_calls_fail_at_once(monkeypatch):
    import threading

    from bcp.coordination import gloo_network
    from bcp.errors import GroupConnectError

    monkeypatch.setattr(gloo_network, "_STUCK", [])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    release = threading.Event()
    choice = gloo_network.Choice(None, "127.0.1.1", "the host name 'h' resolves to 127.0.1.1")
    started = time.monotonic()
    with pytest.raises(GroupConnectError) as caught:
        gloo_network._with_watchdog(lambda: release.wait(30), 3, choice, 0.3)
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert "rank 3" in message and "127.0.1.1" in message and "GLOO_SOCKET_IFNAME" in message
    assert "BCP_GLOO_CONNECT_TIMEOUT (now 0.3 s)" in message
    assert caught.value.rank == 3 and caught.value.address == "127.0.1.1"
    with pytest.raises(GroupConnectError, match="still stuck"):
        gloo_network.create_group(lambda: pytest.fail("must not try again"))
    release.set()
    gloo_network._STUCK[0][0].join(5)

    # gloo's own connect errors (a refused connection) carry the same advice
    def refused():
        raise RuntimeError("Gloo connectFullMesh failed with ... Connection refused, remote=[127.0.1.1]:5548")

    with pytest.raises(GroupConnectError, match="GLOO_SOCKET_IFNAME") as caught:
        gloo_network._with_watchdog(refused, 1, choice, 5)
    assert "Connection refused" in str(caught.value) and isinstance(caught.value.__cause__, RuntimeError)


def test_a_bad_connect_timeout_names_the_variable(monkeypatch):
    from bcp.coordination import gloo_network

    monkeypatch.setenv("BCP_GLOO_CONNECT_TIMEOUT", "30s")
    with pytest.raises(ValueError, match="BCP_GLOO_CONNECT_TIMEOUT"):
        gloo_network.connect_timeout()
    monkeypatch.setenv("BCP_GLOO_CONNECT_TIMEOUT", "")
    assert gloo_network.connect_timeout() == 30
