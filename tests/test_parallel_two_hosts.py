"""A real two-host job: two network namespaces on this machine, an ssh server in one, Open MPI
starting the ranks of the other over ssh — as on a cluster, where ``mpiexec --hostfile`` reaches
the second node through ssh and its ranks get none of the launcher's environment.

The hosts (``TwoHosts``): namespaces ``a`` and ``b`` joined by a veth pair, 127.0.100.1 and
127.0.100.2 — loopback-range addresses of our own namespaces, routed between them
(``route_localnet``), never any other address; each namespace's ``lo`` keeps only 127.0.0.1 (PMIx
talks to its local server there). Each host has its own hostname (a UTS namespace: cnn-host-a,
cnn-host-b), so that Open MPI's session directories and the checks' messages tell them apart; they
share the filesystem (the checkout, the virtual environment, the data), like nodes on a shared
filesystem — except one folder, ``only-on-a``, which an empty tmpfs hides on host b: what the
launcher's host has and the other lacks. sshd (Debian's openssh-server; ``.ci/run`` installs it)
runs on host b with a key made for the test, and Open MPI's ssh agent is ``ssh -F`` a config that
uses that key and trusts the generated host key without asking (StrictHostKeyChecking off).

The tests: the launcher's synchronous run over both hosts equals one process (the remote rank got
``CNN_DATA_DIR`` through ``-x``); plain ``mpiexec`` without ``-x`` stops in one line naming host b;
the launcher's preflight names host b when the interpreter or the dataset is missing there; kill -9
of the rank on host b stops the job with its checkpoint within 1.5 timeouts, and ``--resume``
ends on the weights of an uninterrupted run; Downpour carries on without host b's replica.
Skipped, with the reason, only where namespaces and ssh are impossible (not root, no ``ip``/sshd).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")

from cnn.parallel import launch  # noqa: E402
from test_parallel import (MPIEXEC, assert_same_weights, checkpoint_of, data_dir, one_process,  # noqa: E402,F401
                           write_learnable_mnist)
from test_parallel_faults import FAULTS_MISSING, clocked, seconds_of  # noqa: E402

ADDRESSES = {"a": "127.0.100.1", "b": "127.0.100.2"}
SSHD = "/usr/sbin/sshd"


def impossible() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if MPIEXEC is None:
        return "mpiexec not installed"
    if launch.mpi_version(MPIEXEC).flavour != "openmpi":
        return "the two-host setup drives Open MPI (its ssh agent and TCP settings)"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool, package in ((shutil.which("ip"), "iproute2"), (shutil.which("unshare"), "util-linux"),
                          (shutil.which("ssh"), "openssh-client"), (shutil.which("ssh-keygen"), "openssh-client"),
                          (SSHD if Path(SSHD).exists() else None, "openssh-server")):
        if tool is None:
            return f"{package} is not installed (.ci/run installs it with apt-get)"
    return None


pytestmark = [pytest.mark.mpi, pytest.mark.skipif(impossible() is not None, reason=impossible() or "")]


def sh(*argv, check=True, **kwargs):
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60, **kwargs)


class TwoHosts:
    """Two network namespaces with an ssh server in ``b``; ``on_a`` runs a command on host a."""

    def __init__(self, scratch: Path):
        tag = str(os.getpid())
        self.scratch = scratch
        self.netns = {name: f"cnn2h-{name}-{tag}" for name in ADDRESSES}
        self.veth = {name: f"c2h{name}{tag}"[:15] for name in ADDRESSES}
        self.hidden = scratch / "only-on-a"                   # an empty tmpfs over it on host b
        self.hidden.mkdir()
        self.hostfile = scratch / "hosts"
        self.sshd_pid = None

    def start(self) -> None:
        for name in ADDRESSES:
            sh("ip", "netns", "add", self.netns[name])
        sh("ip", "link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"])
        for name, address in ADDRESSES.items():
            ns, veth = self.netns[name], self.veth[name]
            sh("ip", "link", "set", veth, "netns", ns)
            for key in ("all", veth):                         # let 127.x addresses travel over the veth
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.conf.{key}.route_localnet=1")
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")      # lo keeps 127.0.0.1 alone, not 127/8,
            sh("ip", "-n", ns, "addr", "del", "127.0.0.1/8", "dev", "lo", check=False)   # which would
            sh("ip", "-n", ns, "addr", "add", "127.0.0.1/32", "dev", "lo")               # swallow 127.0.100.x
        self._start_sshd()
        self.hostfile.write_text(f"{ADDRESSES['a']} slots=2\n{ADDRESSES['b']} slots=1\n")

    def _start_sshd(self) -> None:
        keys = self.scratch / "ssh"
        keys.mkdir()
        for name in ("client", "host"):
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name))
        shutil.copy(keys / "client.pub", keys / "authorized_keys")
        (keys / "sshd_config").write_text("\n".join([
            f"ListenAddress {ADDRESSES['b']}", f"HostKey {keys / 'host'}", f"AuthorizedKeysFile {keys / 'authorized_keys'}",
            f"PidFile {keys / 'sshd.pid'}", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", ""]))
        (keys / "ssh_config").write_text("\n".join([
            "Host *", f"  IdentityFile {keys / 'client'}", "  IdentitiesOnly yes", "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null", "  LogLevel ERROR", "  BatchMode yes", "  ConnectTimeout 20", ""]))
        self.agent = keys / "ssh"
        self.agent.write_text(f'#!/bin/sh\nexec ssh -F {keys / "ssh_config"} "$@"\n')
        self.agent.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)               # sshd's privilege separation directory
        script = (f"hostname cnn-host-b && mount -t tmpfs tmpfs {self.hidden} && "
                  f"exec {SSHD} -f {keys / 'sshd_config'} -E {keys / 'sshd.log'}")
        sh("ip", "netns", "exec", self.netns["b"], "unshare", "--uts", "sh", "-c", script)
        for _ in range(200):                                  # sshd writes its pid once it has detached
            if (keys / "sshd.pid").exists() and (keys / "sshd.pid").read_text().strip():
                break
            time.sleep(0.05)
        self.sshd_pid = int((keys / "sshd.pid").read_text())
        answer = sh(*self.on_a(["ssh", "-F", str(keys / "ssh_config"), ADDRESSES["b"], "hostname"]))
        assert answer.stdout.strip() == "cnn-host-b", answer

    def on_a(self, argv: list[str]) -> list[str]:
        """``argv`` run on host a (its namespace, its hostname)."""
        return ["ip", "netns", "exec", self.netns["a"], "unshare", "--uts", "sh", "-c",
                'hostname cnn-host-a && exec "$@"', "sh", *argv]

    def env(self, **extra) -> dict:
        """The environment of a launch on host a: Open MPI reaches b through the test's ssh, and its TCP
        transport uses the veth's addresses (Open MPI leaves 127.x out by default)."""
        env = launch.environment({"PRTE_MCA_plm_ssh_agent": str(self.agent),
                                  "OMPI_MCA_btl_tcp_if_include": "127.0.100.0/24", **extra})
        env.pop("CNN_DATA_DIR", None)
        return {**env, **extra}

    def stop(self) -> None:
        pid_file = self.scratch / "ssh" / "sshd.pid"
        if not self.sshd_pid and pid_file.exists() and pid_file.read_text().strip():
            self.sshd_pid = int(pid_file.read_text())        # started, but the set-up failed after it
        if self.sshd_pid:
            try:
                os.kill(self.sshd_pid, 15)
            except ProcessLookupError:
                pass
        for ns in self.netns.values():
            sh("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    two = TwoHosts(tmp_path_factory.mktemp("two-hosts"))
    try:
        two.start()
    except (subprocess.CalledProcessError, OSError) as err:
        two.stop()
        detail = getattr(err, "stderr", "") or str(err)
        pytest.fail(f"could not set up two hosts: {' '.join(str(detail).split())[:300]}")
    yield two
    two.stop()


def launcher(hosts: TwoHosts, ranks: int, flags: list[str]) -> list[str]:
    return hosts.on_a([sys.executable, "-m", "cnn.parallel.launch", "-n", str(ranks), "--hostfile",
                       str(hosts.hostfile), *flags])


def small(tmp_path, name="run", **extra) -> list[str]:
    flags = {"batch-size": 8, "epochs": 1, "lr": 0.02, "limit-train": 128, "checkpoint": tmp_path / f"{name}.npz",
             "summary": tmp_path / f"{name}.json", **extra}
    return [part for key, value in flags.items() for part in (f"--{key}", str(value))] + ["--no-progress"]


def test_a_synchronous_run_across_two_hosts_equals_one_process(hosts, data_dir, tmp_path):
    """The launcher forwards CNN_DATA_DIR (-x), the preflight passes, rank 2 runs on host b."""
    argv = launcher(hosts, 3, ["--strategy", "allreduce", "--allreduce", "ring", *small(tmp_path)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=hosts.env(CNN_DATA_DIR=str(data_dir)))
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "-x CNN_DATA_DIR" in done.stdout.splitlines()[0]
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["status"] in ("completed", "did not learn"), done.stderr[-2000:]
    expected, _ = one_process(data_dir, 24, limit_train=128, schedule="warmup", lr_scale=3)
    assert_same_weights(checkpoint_of(tmp_path / "run.npz")["params"], expected)


def test_plain_mpiexec_without_forwarding_stops_in_one_line_naming_the_host(hosts, data_dir, tmp_path):
    """CNN_DATA_DIR set for the launcher, not forwarded: the rank on host b finds no dataset (or
    another one) and the job says so before training, one line, exit 2."""
    argv = hosts.on_a([MPIEXEC, "--hostfile", str(hosts.hostfile), "-n", "3", sys.executable, "-m", "mpi4py", "-m",
                       "cnn.parallel", "--strategy", "allreduce", *small(tmp_path)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=hosts.env(CNN_DATA_DIR=str(data_dir)))
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("python -m cnn.parallel: error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    assert "host cnn-host-b (rank 2)" in errors[0] and "CNN_DATA_DIR is set for rank 0, not there" in errors[0]
    assert not (tmp_path / "run.npz").exists()


def test_the_preflight_names_the_host_that_lacks_the_interpreter_or_the_dataset(hosts, data_dir, tmp_path):
    python = hosts.hidden / "python"                          # exists on host a only
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    hidden_data = hosts.hidden / "data"
    shutil.copytree(data_dir, hidden_data)
    script = ("import sys; from cnn.parallel.launch import preflight; "
              f"print('\\n'.join(preflight({str(hosts.hostfile)!r}, python={str(python)!r})))")
    done = subprocess.run(hosts.on_a([sys.executable, "-c", script]), capture_output=True, text=True, timeout=300,
                          env=hosts.env())
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"host cnn-host-b: no interpreter {python}"), done
    argv = launcher(hosts, 3, ["--strategy", "allreduce", *small(tmp_path)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=hosts.env(CNN_DATA_DIR=str(hidden_data)))
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "host cnn-host-b: " in errors[0], done.stderr[-2000:]
    # host b looks past the hidden folder: it finds nothing, or the repository's data/mnist if fetched
    assert "no dataset" in errors[0] or f"differs from rank 0's in {hidden_data}" in errors[0], errors[0]


@pytest.mark.skipif(FAULTS_MISSING is not None, reason=FAULTS_MISSING or "")
def test_kill_9_on_host_b_stops_within_one_and_a_half_timeouts_and_resume_is_exact(hosts, data_dir, tmp_path):
    timeout = 4.0
    flags = ["--strategy", "allreduce", *small(tmp_path), "--kill-rank", "2", "--kill-at-step", "2",
             "--peer-timeout", str(timeout)]
    code, lines, ended = clocked(launcher(hosts, 3, flags), hosts.env(CNN_DATA_DIR=str(data_dir)))
    killed = seconds_of(lines, "killing itself")
    assert code == 1, lines
    assert ended - killed <= 1.5 * timeout + 2.0, (ended - killed, lines)   # MPI itself may report the loss sooner
    # MPI (ULFM) reports the failure to the collective in flight: a survivor may still have been finishing
    # step 1's allreduce when rank 2 died at the start of step 2, and then the checkpoint is of step 1.
    # Known limit: across hosts the roll call sometimes misses the live rank 1's answer (about 1 stop in 3
    # under load) and names it lost too; the checkpoint, the exit and the resume are right all the same.
    stops = [re.search(r"rank\(s\) ([\d, ]+) lost .* checkpoint of the last completed step \([12]\)", line)
             for _, line in lines]
    assert any(stop and "2" in stop.group(1).split(", ") for stop in stops), lines
    argv = launcher(hosts, 3, ["--strategy", "allreduce", *small(tmp_path), "--resume"])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=hosts.env(CNN_DATA_DIR=str(data_dir)))
    assert done.returncode in (0, 1), done.stderr[-2000:]
    expected, _ = one_process(data_dir, 24, limit_train=128, schedule="warmup", lr_scale=3)
    assert_same_weights(checkpoint_of(tmp_path / "run.npz")["params"], expected)


@pytest.mark.skipif(FAULTS_MISSING is not None, reason=FAULTS_MISSING or "")
def test_downpour_carries_on_without_the_replica_on_host_b(hosts, data_dir, tmp_path):
    timeout = 4.0
    flags = ["--strategy", "downpour", *small(tmp_path, **{"limit-train": 256, "epochs": 2}), "--kill-rank", "2",
             "--kill-at-step", "3", "--peer-timeout", str(timeout), "--init", "xavier", "--momentum", "0.5"]
    code, lines, _ = clocked(launcher(hosts, 3, flags), hosts.env(CNN_DATA_DIR=str(data_dir)))
    delay = seconds_of(lines, "rank 2 silent") - seconds_of(lines, "killing itself")
    assert delay <= 1.25 * timeout + 2.0, (delay, lines)
    assert code == 1, lines
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "completed without rank(s) 2"
