"""What this machine offers a 1 kHz loop, as JSON: CPUs, frequency governor, idle states and their
exit latencies, whether /dev/cpu_dma_latency can be held, real-time scheduling rights, isolated
CPUs, steal time. Overruns of a bare timer thread (bench/ros_floors.py) come from these, not from
the node; a result file beside a benchmark says which ones the machine had.

    python3 bench/host_facts.py [--out FILE] [--steal-s 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

CPU = Path("/sys/devices/system/cpu")
CAP_SYS_NICE = 23


def read(path: Path | str, default: str = "") -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


def idle_states() -> list[dict]:
    """cpu0's idle states (the others are alike on these machines): name, exit latency, whether
    disabled."""
    out = []
    for d in sorted((CPU / "cpu0" / "cpuidle").glob("state*")):
        out.append(
            {
                "name": read(d / "name"),
                "latency_us": int(read(d / "latency", "-1")),
                "disabled": read(d / "disable") == "1",
            }
        )
    return out


def dma_latency() -> str:
    """Whether a process may hold /dev/cpu_dma_latency (PM QoS: keeps CPUs out of deep idle
    states while the file is open), as cyclictest does."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError as e:
        return f"no: {e.strerror}"
    try:
        os.write(fd, (0).to_bytes(4, "little"))
        return "yes"
    except OSError as e:
        return f"open but not writable: {e.strerror}"
    finally:
        os.close(fd)


def capabilities() -> dict:
    eff = 0
    for line in read("/proc/self/status").splitlines():
        if line.startswith("CapEff:"):
            eff = int(line.split()[1], 16)
    fifo = "not tried"
    if hasattr(os, "SCHED_FIFO"):
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            fifo = "yes"
        except OSError as e:
            fifo = f"no: {e.strerror}"
    return {
        "uid": os.getuid(),
        "cap_sys_nice": bool(eff >> CAP_SYS_NICE & 1),
        "sched_fifo": fifo,
        "rtprio_limit": next(
            (
                ln.split()[3]
                for ln in read("/proc/self/limits").splitlines()
                if ln.startswith("Max realtime priority")
            ),
            "",
        ),
    }


def stat_total() -> list[int]:
    """The all-CPU counters of /proc/stat (user, nice, system, idle, iowait, irq, softirq,
    steal, ...); [] where there is none."""
    with contextlib.suppress(IndexError, ValueError):
        return [int(v) for v in read("/proc/stat").splitlines()[0].split()[1:]]
    return []


def steal_between(a: list[int], b: list[int]) -> float | None:
    """Percent of all CPU time, idle included, stolen by the hypervisor between two
    stat_total() samples; None where there is no steal counter."""
    d = [y - x for x, y in zip(a, b, strict=False)]
    return round(100 * d[7] / (sum(d) or 1), 2) if len(d) > 7 else None


def steal(seconds: float) -> dict:
    """CPU time stolen by a hypervisor and spent idle over `seconds`, all CPUs (/proc/stat)."""
    a = stat_total()
    time.sleep(seconds)
    b = stat_total()
    d = [y - x for x, y in zip(a, b, strict=False)]
    return {
        "seconds": seconds,
        "steal_pct": steal_between(a, b) or 0.0,
        "idle_pct": round(100 * d[3] / (sum(d) or 1), 1),
    }


def cpu_model() -> dict:
    """The CPU's model name and how many hardware threads share a core (2: SMT, where two
    busy threads on siblings each run slower)."""
    lines = read("/proc/cpuinfo").splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    sib = read(CPU / "cpu0" / "topology" / "thread_siblings_list")
    return {"model": model, "threads_per_core": len(cpu_list(sib)) if sib else None}


def cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8") as numbers."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def threads(pid: int) -> dict[int, dict]:
    """Each thread of process `pid` by thread id: its kernel name, the CPU time it has used (s),
    the CPU it last ran on, that CPU's hardware siblings and how many CPUs it may use."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, dict] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            cpu = int(stat[36])  # field 39, "processor"
            # time on a CPU in ns (schedstat) where the kernel keeps it; else utime + stime,
            # counted in clock ticks (10 ms), too coarse for a 10 ms sample
            sched = read(task / "schedstat").split()
            cpu_s = int(sched[0]) / 1e9 if sched else (int(stat[11]) + int(stat[12])) / tick
            out[int(task.name)] = {
                "name": (task / "comm").read_text().strip(),
                "cpu_s": cpu_s,
                "last_cpu": cpu,
                "siblings": read(CPU / f"cpu{cpu}" / "topology" / "thread_siblings_list"),
                "allowed": len(os.sched_getaffinity(int(task.name))),
            }
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            pass
    return out


def thread_use(before: dict[int, dict], after: dict[int, dict], seconds: float) -> list[dict]:
    """The threads that ran between two threads() samples, busiest first: CPU percent of one
    core over the `seconds` between them, where each was last, and its siblings."""
    rows = []
    for tid, a in after.items():
        used = a["cpu_s"] - before.get(tid, {"cpu_s": 0.0})["cpu_s"]
        if used > 0:
            pct = round(100 * used / max(seconds, 1e-9), 1)
            row = {"tid": tid, "name": a["name"], "cpu_pct": pct}
            rows.append(row | {k: a[k] for k in ("last_cpu", "siblings", "allowed")})
    return sorted(rows, key=lambda r: -r["cpu_pct"])


def core_of(cpu: int) -> str:
    """The hardware core a CPU number belongs to, named by its siblings ("3,11"): two threads on
    one core share its execution units, so a busy one slows the other."""
    return read(CPU / f"cpu{cpu}" / "topology" / "thread_siblings_list", str(cpu))


class ThreadSampler:
    """Samples threads(pid) every `period` s while in a `with` block, so that where a thread ran
    is known for the whole window, not only at its end. The sampling runs in a process of its
    own: in the measuring process it took the GIL from the client timing the calls (a sample of
    41 threads took ~2 ms on the 2-core CPU machine, a fifth of each 10 ms)."""

    def __init__(self, pid: int, period: float = 0.01) -> None:
        self.pid, self.period = pid, period
        self.samples: list[dict[int, dict]] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> ThreadSampler:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--sample-threads", str(self.pid)]
        self._proc = subprocess.Popen(
            [*cmd, "--period", str(self.period)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._proc.stdout.readline().strip() != "sampling":  # its first sample is taken
            raise RuntimeError(f"the thread sampler of pid {self.pid} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._proc.communicate(input="", timeout=30)  # stdin closed: it stops
        self.samples = [{int(t): row for t, row in s.items()} for s in json.loads(out or "[]")]

    def core_sharing(self) -> dict:
        """For each thread that ran during the window but the busiest (the one that used the
        most CPU over it), the percent of the intervals in which it ran that it ended on the
        busiest one's core: near 0 means it had a core of its own, higher means it shared the
        busy loop's (another hyperthread of it, or the same CPU)."""
        samples = [s for s in self.samples if s]
        if len(samples) < 2:
            return {}
        first_seen: dict[int, dict] = {}  # a thread's first sample (threads may start late)
        for s in samples:
            for t, row in s.items():
                first_seen.setdefault(t, row)
        last = samples[-1]
        used = {t: last[t]["cpu_s"] - first_seen[t]["cpu_s"] for t in last}
        busiest = max(used, key=used.get)
        out = {}
        for t in (t for t in used if t != busiest and used[t] > 0):
            hits = ran = 0  # over the intervals in which t ran (its CPU time advanced)
            for prev, cur in zip(samples, samples[1:], strict=False):
                if t in prev and t in cur and busiest in cur:
                    if cur[t]["cpu_s"] > prev[t]["cpu_s"]:
                        ran += 1
                        hits += core_of(cur[t]["last_cpu"]) == core_of(cur[busiest]["last_cpu"])
            if ran:
                out[f"{last[t]['name']}/{t}"] = round(100 * hits / ran, 1)
        return out


def sample_threads(pid: int, period: float) -> int:
    """The sampler process: threads(pid) every `period` s until stdin closes (or the process
    ends), then every sample as one JSON list on stdout."""
    samples = [threads(pid)]
    print("sampling", flush=True)
    while not select.select([sys.stdin], [], [], period)[0]:
        cur = threads(pid)
        if not cur:  # the process ended
            break
        samples.append(cur)
    print(json.dumps(samples))
    return 0


def net_shm_load(shm: Path = Path("/dev/shm")) -> dict:
    """The machine-wide state a DDS transport depends on, cheap enough to take around every
    scenario: the kernel's UDP counters (a datagram dropped for a full receive buffer counts in
    RcvbufErrors), the Fast DDS shared-memory files (count, bytes) and the 1-minute load. Two
    of these taken around a scenario say whether its messages went by UDP and lost some, or
    whether ports and segments piled up."""
    udp: dict = {}
    lines = [ln.split() for ln in read("/proc/net/snmp").splitlines() if ln.startswith("Udp:")]
    if len(lines) == 2:
        udp = {k: int(v) for k, v in zip(lines[0][1:], lines[1][1:], strict=False)}
    files, size = 0, 0
    try:
        for e in os.scandir(shm):
            if e.name.startswith(("fastdds_", "fastrtps_", "sem.fastdds_", "sem.fastrtps_")):
                files += 1
                with contextlib.suppress(OSError):
                    size += e.stat().st_size
    except OSError:
        pass
    load = read("/proc/loadavg").split()
    return {
        "udp": udp,
        "shm_files": files,
        "shm_bytes": size,
        "load1": float(load[0]) if load else None,
    }


def fastdds_segment_bytes() -> int:
    """The largest Fast DDS shared-memory segment this process has mapped (0: none): 8 MiB and
    more once config/fastdds_images.xml is in effect, ~540 KB with Fast DDS's default. Alone in
    its domain, every segment a process maps is its own."""
    out = 0
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/fastdds_" in line and "_el" not in line and "port" not in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out = max(out, hi - lo)
    return out


def net_shm_delta(before: dict, after: dict) -> dict:
    """What changed between two net_shm_load()s: the UDP counters that moved, the shared-memory
    files then, and the load after."""
    ub, ua = before.get("udp", {}), after.get("udp", {})
    return {
        "udp": {k: ua[k] - ub[k] for k in ua if k in ub and ua[k] != ub[k]},
        "shm_files": [before.get("shm_files"), after.get("shm_files")],
        "shm_mib": [round(x.get("shm_bytes", 0) / 2**20, 1) for x in (before, after)],
        "load1": after.get("load1"),
    }


def facts(steal_s: float) -> dict:
    govs = sorted({read(p / "cpufreq" / "scaling_governor", "none") for p in CPU.glob("cpu[0-9]*")})
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "cores": len({core_of(int(p.name[3:])) for p in CPU.glob("cpu[0-9]*")}),
        "affinity": len(os.sched_getaffinity(0)),
        "governors": govs,
        "isolated": read(CPU / "isolated"),
        "nohz_full": read(CPU / "nohz_full"),
        "idle_driver": read(CPU / "cpuidle" / "current_driver", "none"),
        "idle_states": idle_states(),
        "cpu_dma_latency": dma_latency(),
        "rights": capabilities(),
        "sched_rt_runtime_us": read("/proc/sys/kernel/sched_rt_runtime_us"),
        "kernel": os.uname().release,
        "loadavg": read("/proc/loadavg"),
        **{"stat": steal(steal_s)},
    }


def emit(result: dict, out: Path | None) -> None:
    """Print a probe's JSON, and write it to `out` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--steal-s", type=float, default=2.0, help="window of the steal sample (s)")
    ap.add_argument(
        "--sample-threads",
        type=int,
        metavar="PID",
        help="instead: sample PID's threads every --period s until stdin closes (ThreadSampler)",
    )
    ap.add_argument("--period", type=float, default=0.01, help="with --sample-threads (s)")
    a = ap.parse_args()
    if a.sample_threads is not None:
        return sample_threads(a.sample_threads, a.period)
    emit(facts(a.steal_s), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
