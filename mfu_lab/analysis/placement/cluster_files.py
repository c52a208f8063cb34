"""A GPU cluster as step 6 sees it: leaf switches, nodes, GPUs and the links between them.

A cluster file is YAML under ``parameters/`` (see ``parameters/clusters/example_h100.yaml``).
Its switches and nodes can come from the file itself (``switches`` x
``nodes_per_switch``) or from a Slurm ``topology.conf``; GPUs per node and the
intra-node link can come from the matrix ``nvidia-smi topo -m`` prints. Every
problem is reported with the file, the key (or line) and what is allowed.

Bounds: the files a cluster file names are read as the YAML is (:func:`mfu_lab.core.job.yamlfile.read_text`: at
most a megabyte, UTF-8 text), and a cluster holds at most :data:`MAX_NODES` nodes and :data:`MAX_GPUS` GPUs
(more than any built), counted before a node list is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.job import yamlfile
from mfu_lab.core.measure import device as dev


class ClusterError(JobError):
    """A cluster file, Slurm topology.conf or nvidia-smi matrix that cannot be used."""


MAX_NODES = 100_000  # nodes in one cluster: the largest built hold about a tenth of that
MAX_GPUS = 1_000_000
TOO_MANY = f"at most {MAX_NODES:,} nodes in a cluster (more than any built)"


# ------------------------------------------------------------------ Slurm topology.conf
_HOSTLIST = re.compile(r"([^,\[]*)(\[[^\]]*\])?([^,\[]*)")


def expand_hostlist(text: str, where: str, key: str = "Nodes", limit: int = MAX_NODES) -> list[str]:
    """Slurm hostlist syntax: ``gpu[001-004,007],login1`` -> gpu001 ... gpu004, gpu007, login1.

    Zero padding is kept from the range's first bound, as Slurm does. ``where``
    names the file and line for the error; a list of more than ``limit`` names is refused before it is built.
    """
    out: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _HOSTLIST.match(text, pos)
        prefix, brackets, suffix = m.group(1), m.group(2), m.group(3)
        if not (prefix or brackets):
            raise ClusterError(where, [JobProblem(key, text, "an empty host name in the list")])
        if brackets:
            for part in brackets[1:-1].split(","):
                r = re.fullmatch(r"(\d{1,12})(?:-(\d{1,12}))?", part.strip())
                if not r:
                    raise ClusterError(where, [JobProblem(key, text, f"range '{part}' must be N or N-M (digits, up "
                                                                     "to 12 each)")])
                lo, hi = r.group(1), r.group(2) or r.group(1)
                if int(hi) < int(lo):
                    raise ClusterError(where, [JobProblem(key, text, f"range '{part}' runs backwards")])
                if int(hi) - int(lo) > 100_000:
                    raise ClusterError(where, [JobProblem(key, text, f"range '{part}' is implausibly large")])
                if len(out) + int(hi) - int(lo) + 1 > limit:
                    raise ClusterError(where, [JobProblem(key, text, f"names more nodes than fit: {TOO_MANY}")])
                out += [f"{prefix}{str(i).zfill(len(lo))}{suffix}" for i in range(int(lo), int(hi) + 1)]
        else:
            if len(out) >= limit:
                raise ClusterError(where, [JobProblem(key, text, f"names more nodes than fit: {TOO_MANY}")])
            out.append(prefix + suffix)
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise ClusterError(where, [JobProblem(key, text, f"unexpected '{text[pos]}' at character {pos}")])
            pos += 1
    return out


def parse_topology_conf(text: str, source: str = "topology.conf") -> dict[str, list[str]]:
    """Leaf switches -> their nodes, from a Slurm ``topology.conf`` (tree plugin).

    Lines are ``SwitchName=s0 Nodes=gpu[01-04] [LinkSpeed=N]`` (a leaf) or
    ``SwitchName=spine Switches=s[0-1]`` (above the leaves); ``#`` starts a
    comment. A node under two leaves, a switch defined twice, a parent naming a
    switch that does not exist, or an unknown key is an error naming the line.
    """
    leaves: dict[str, list[str]] = {}
    parents: dict[str, tuple[list[str], str]] = {}
    owner: dict[str, str] = {}
    children = 0  # switches named under the parents, bounded as the nodes are
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {no}"
        fields: dict[str, str] = {}
        for tok in line.split():
            if "=" not in tok:
                raise ClusterError(where, [JobProblem("(line)", raw.strip(), f"'{tok}' is not Key=Value")])
            k, v = tok.split("=", 1)
            if k not in ("SwitchName", "Nodes", "Switches", "LinkSpeed"):
                raise ClusterError(where, [JobProblem(k, v, "unknown key; allowed: SwitchName, Nodes, Switches, "
                                                            "LinkSpeed")])
            fields[k] = v
        name = fields.get("SwitchName")
        if not name:
            raise ClusterError(where, [JobProblem("SwitchName", raw.strip(), "every line must name its switch")])
        if name in leaves or name in parents:
            raise ClusterError(where, [JobProblem("SwitchName", name, "defined twice")])
        if "Nodes" in fields and "Switches" in fields:
            raise ClusterError(where, [JobProblem("SwitchName", name, "has both Nodes and Switches; a switch "
                                                                      "holds one or the other")])
        if "Nodes" in fields:
            nodes = expand_hostlist(fields["Nodes"], where, limit=MAX_NODES - len(owner))
            for n in nodes:
                if n in owner:
                    raise ClusterError(where, [JobProblem("Nodes", n, f"already under switch {owner[n]}")])
                owner[n] = name
            leaves[name] = nodes
        elif "Switches" in fields:
            parents[name] = (expand_hostlist(fields["Switches"], where, "Switches", MAX_NODES - children), where)
            children += len(parents[name][0])
        else:
            raise ClusterError(where, [JobProblem("SwitchName", name, "needs Nodes= (a leaf) or Switches=")])
    for children, where in parents.values():
        for c in children:
            if c not in leaves and c not in parents:
                raise ClusterError(where, [JobProblem("Switches", c, "names a switch that no line defines")])
    if not leaves:
        raise ClusterError(source, [JobProblem("(file)", source, "defines no leaf switch (no line with Nodes=)")])
    return leaves


# ------------------------------------------------------------------ nvidia-smi topo -m
NVLINK_GBPS_PER_LINK = 25.0  # GB/s per NVLink link per direction (NVLink 2, 3 and 4; NVLink 5 doubles it)
PCIE_GBPS = {"PIX": 24.0, "PXB": 24.0, "PHB": 20.0, "NODE": 16.0, "SYS": 12.0}  # assumed PCIe Gen4 x16 paths
LINK_MEANING = {"X": "self", "PIX": "one PCIe bridge", "PXB": "several PCIe bridges", "PHB": "PCIe host bridge",
                "NODE": "PCIe across host bridges in one NUMA node", "SYS": "PCIe across NUMA nodes (SMP link)",
                "NV#": "bonded NVLinks"}


@dataclass
class GpuTopology:
    """What ``nvidia-smi topo -m`` says about one node's GPUs."""

    gpus: int
    links: list[list[str]]  # GPU x GPU link codes (X on the diagonal)
    nics: list[str] = field(default_factory=list)

    def pair_gbps(self, code: str, per_link: float = NVLINK_GBPS_PER_LINK) -> float:
        if code.startswith("NV"):
            return int(code[2:]) * per_link
        return PCIE_GBPS[code]

    def bottleneck_gbps(self, per_link: float = NVLINK_GBPS_PER_LINK) -> tuple[float, str]:
        """The slowest GPU-to-GPU link (a ring across all GPUs crosses it), and its code."""
        pairs = [(self.pair_gbps(c, per_link), c) for i, row in enumerate(self.links) for j, c in enumerate(row)
                 if i != j]
        return min(pairs) if pairs else (float("inf"), "X")


def parse_nvidia_smi_topo(text: str, source: str = "nvidia-smi topo -m") -> GpuTopology:
    """The GPU x GPU matrix of ``nvidia-smi topo -m`` (the legend and NIC rows are read, not needed)."""
    lines = [ln.rstrip("\n") for ln in text.splitlines()]
    header_no = next((i for i, ln in enumerate(lines) if re.match(r"^\s+GPU0\b", ln)), None)
    if header_no is None:
        raise ClusterError(source, [JobProblem("(header)", text[:60], "no header line starting with GPU0; paste the "
                                                                     "output of `nvidia-smi topo -m`")])
    header = lines[header_no].split()
    gpu_cols = [h for h in header if re.fullmatch(r"GPU\d+", h)]
    ncols = len(gpu_cols)
    link_cols = len([h for h in header if re.fullmatch(r"(GPU|NIC)\d+", h)])
    rows: list[list[str]] = []
    nics: list[str] = []
    for no in range(header_no + 1, len(lines)):
        ln = lines[no]
        if not ln.strip():
            break  # the legend follows a blank line
        cells = ln.split()
        name = cells[0]
        where = f"{source}, line {no + 1}"
        if re.fullmatch(r"NIC\d+", name):
            nics.append(name)
            continue
        if not re.fullmatch(r"GPU\d+", name):
            raise ClusterError(where, [JobProblem("(row)", name, "a matrix row must start with GPU<n> or NIC<n>")])
        if name != f"GPU{len(rows)}":
            raise ClusterError(where, [JobProblem("(row)", name, f"expected GPU{len(rows)} (rows in order)")])
        codes = cells[1:1 + ncols]
        if len(cells) < 1 + link_cols:
            raise ClusterError(where, [JobProblem(name, " ".join(cells[1:]),
                                                  f"has {len(cells) - 1} cells; the header has {link_cols} link "
                                                  "columns")])
        for j, c in enumerate(codes):
            if not (c == "X" or re.fullmatch(r"NV\d+", c) or c in PCIE_GBPS):
                raise ClusterError(where, [JobProblem(f"{name}/{gpu_cols[j]}", c, "unknown link; allowed: X, NV<n>, "
                                                      + ", ".join(PCIE_GBPS))])
            if (c == "X") != (j == len(rows)):
                raise ClusterError(where, [JobProblem(f"{name}/{gpu_cols[j]}", c, "X belongs on the diagonal only")])
        rows.append(codes)
    if len(rows) != ncols:
        raise ClusterError(source, [JobProblem("(matrix)", len(rows), f"{ncols} GPU columns but {len(rows)} GPU rows")])
    for i in range(ncols):
        for j in range(ncols):
            if rows[i][j] != rows[j][i]:
                raise ClusterError(source, [JobProblem(f"GPU{i}/GPU{j}", rows[i][j],
                                                       f"differs from GPU{j}/GPU{i} ({rows[j][i]}); the matrix must be "
                                                       "symmetric")])
    return GpuTopology(ncols, rows, nics)


# ------------------------------------------------------------------ the cluster file
@dataclass(frozen=True)
class QueueEntry:
    name: str
    arrival_h: float
    gpus: int
    hours: float


@dataclass
class Cluster:
    name: str
    gpu: str  # the device table's chip name
    gpu_memory_gb: float
    gpus_per_node: int
    switches: dict[str, list[str]]  # leaf switch -> node names, in order
    intra_node_gbps: float  # all-reduce bus bandwidth inside a node (GB/s)
    node_network_gbps: float  # one node's injection bandwidth into its leaf switch, all NICs together (GB/s)
    oversubscription: float  # a leaf's downlink:uplink capacity ratio (1: non-blocking)
    intra_node_latency_us: float
    inter_node_latency_us: float
    occupied_gpus: int  # the first GPUs (in node order) already taken by other jobs
    queue: list[QueueEntry]
    sources: dict[str, str]  # key -> where its value came from
    topo: GpuTopology | None = None

    @property
    def nodes(self) -> list[str]:
        return [n for ns in self.switches.values() for n in ns]

    @property
    def n_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    @property
    def node_switch(self) -> dict[int, int]:
        """Node index -> leaf switch index."""
        out, i = {}, 0
        for s, ns in enumerate(self.switches.values()):
            for _ in ns:
                out[i] = s
                i += 1
        return out

    def uplink_gbps(self, switch_index: int) -> float:
        """A leaf's uplink capacity: its nodes' injection bandwidth divided by the oversubscription."""
        n = len(list(self.switches.values())[switch_index])
        return n * self.node_network_gbps / self.oversubscription

    def peak_flops(self, dtype: str) -> dev.Peak:
        return dev.datasheet_peak(self.gpu, dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gpu": self.gpu, "gpu_memory_gb": self.gpu_memory_gb,
                "gpus_per_node": self.gpus_per_node, "switches": self.switches, "nodes": len(self.nodes),
                "gpus": self.n_gpus, "intra_node_gbps": self.intra_node_gbps,
                "node_network_gbps": self.node_network_gbps, "oversubscription": self.oversubscription,
                "intra_node_latency_us": self.intra_node_latency_us,
                "inter_node_latency_us": self.inter_node_latency_us, "occupied_gpus": self.occupied_gpus,
                "queue": [vars(q) for q in self.queue], "sources": self.sources,
                "topo": vars(self.topo) if self.topo else None}


_SPEC: dict[str, tuple[type | tuple, str]] = {
    "name": (str, "text naming the cluster"),
    "gpu": (str, "a GPU of the device table: " + ", ".join(c.name for c in dev.PEAK_TABLE)),
    "gpu_memory_gb": ((int, float), "GPU memory in GB, > 0"),
    "gpus_per_node": (int, "a whole number >= 1"),
    "switches": (int, "a whole number of leaf switches >= 1 (or give topology_conf)"),
    "nodes_per_switch": (int, "a whole number >= 1 (or give topology_conf)"),
    "topology_conf": (str, "a path to a Slurm topology.conf, relative to the cluster file"),
    "nvidia_smi_topo": (str, "a path to saved `nvidia-smi topo -m` output, relative to the cluster file"),
    "nvlink_gbps_per_link": ((int, float), "GB/s per NVLink link per direction, > 0"),
    "intra_node_gbps": ((int, float), "all-reduce bus bandwidth inside a node in GB/s, > 0"),
    "node_network_gbps": ((int, float), "one node's network injection bandwidth in GB/s (all NICs), > 0"),
    "oversubscription": ((int, float), "leaf downlink:uplink ratio, >= 1 (1 is non-blocking)"),
    "intra_node_latency_us": ((int, float), "latency in microseconds, >= 0"),
    "inter_node_latency_us": ((int, float), "latency in microseconds, >= 0"),
    "occupied_gpus": (int, "a whole number >= 0 of GPUs other jobs hold (the first ones in node order)"),
    "queue": (list, "a list of {name, arrival_h, gpus, hours} jobs for the gang-scheduling simulation"),
}
_REQUIRED = ("gpu", "gpus_per_node", "intra_node_gbps", "node_network_gbps")
_DEFAULTS = {"gpu_memory_gb": 80.0, "oversubscription": 1.0, "intra_node_latency_us": 3.0,
             "inter_node_latency_us": 10.0, "occupied_gpus": 0, "nvlink_gbps_per_link": NVLINK_GBPS_PER_LINK}


def _check_value(key: str, v: Any) -> str | None:
    want, text = _SPEC[key]
    if isinstance(v, bool) or not isinstance(v, want):
        return f"must be {text}"
    if key == "gpu" and dev.lookup_chip(v) is None:
        return f"must be {text}"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v != v or v in (float("inf"), float("-inf")) or abs(v) > 1e9:
            return f"must be {text} (and finite)"
        low = {"oversubscription": 1, "occupied_gpus": 0, "intra_node_latency_us": 0, "inter_node_latency_us": 0}
        if key in low and v < low[key]:
            return f"must be {text}"
        if key not in low and v <= 0:
            return f"must be {text}"
    if key in ("name",) and not v.strip():
        return "must be non-empty text"
    return None


def _queue(items: list, source: str) -> list[QueueEntry]:
    out, problems = [], []
    for i, q in enumerate(items):
        key = f"queue[{i}]"
        if not isinstance(q, dict) or set(q) != {"name", "arrival_h", "gpus", "hours"}:
            problems.append(JobProblem(key, q, "must be a mapping with exactly name, arrival_h, gpus, hours"))
            continue
        bad = [k for k in ("arrival_h", "hours") if isinstance(q[k], bool) or not isinstance(q[k], (int, float))
               or not 0 <= q[k] < 1e6] + ([] if isinstance(q["gpus"], int) and not isinstance(q["gpus"], bool)
                                          and 0 < q["gpus"] < 1e7 else ["gpus"])
        if bad or q["hours"] == 0:
            problems.append(JobProblem(key, q, "arrival_h >= 0 and hours > 0 (numbers), gpus a whole number >= 1"))
            continue
        out.append(QueueEntry(str(q["name"]), float(q["arrival_h"]), q["gpus"], float(q["hours"])))
    if problems:
        raise ClusterError(source, problems)
    return out


def _text(source: str, key: str, value: str, path: Path) -> str:
    """The text of a file the cluster file names under ``key``, read with the YAML's bounds."""
    try:
        return yamlfile.read_text(path)
    except yamlfile.YamlProblem as e:
        raise ClusterError(source, [JobProblem(key, value, f"{path} {e}")]) from None
    except OSError as e:
        raise ClusterError(source, [JobProblem(key, value, f"{path} cannot be read ({e.strerror or e})")]) from None


def load_cluster(path: str | Path) -> Cluster:
    """Read and check a cluster file (safe YAML). Relative paths inside it are taken from its folder."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ClusterError(source, [JobProblem("(file)", source, "no such cluster file")])
    try:
        data = yamlfile.load(path)
    except yamlfile.YamlProblem as e:
        raise ClusterError(source, [JobProblem("(file)", path.name, str(e))]) from None
    if not isinstance(data, dict):
        raise ClusterError(source, [JobProblem("(file)", type(data).__name__, "must be a mapping of key: value lines")])
    problems = []
    for k, v in data.items():
        if k not in _SPEC:
            problems.append(JobProblem(str(k), v, "unknown key; allowed keys: " + ", ".join(_SPEC)))
        else:
            why = _check_value(k, v)
            if why:
                problems.append(JobProblem(k, v, why))
    has_conf = "topology_conf" in data
    if has_conf and ("switches" in data or "nodes_per_switch" in data):
        problems.append(JobProblem("topology_conf", data["topology_conf"], "give either topology_conf or switches "
                                   "and nodes_per_switch, not both"))
    if not has_conf and not ("switches" in data and "nodes_per_switch" in data):
        problems.append(JobProblem("switches", data.get("switches"), "give switches and nodes_per_switch, or "
                                   "topology_conf"))
    for k in _REQUIRED:
        if k not in data and not (k in ("gpus_per_node", "intra_node_gbps") and "nvidia_smi_topo" in data):
            problems.append(JobProblem(k, None, f"must be given: {_SPEC[k][1]}"))
    if problems:
        raise ClusterError(source, problems)
    values = {**_DEFAULTS, **data}
    sources = {k: ("cluster file" if k in data else "default of mfu-lab") for k in _SPEC if k in values}

    if has_conf:
        conf = path.parent / data["topology_conf"]
        if not conf.is_file():
            raise ClusterError(source, [JobProblem("topology_conf", data["topology_conf"], f"no such file ({conf})")])
        switches = parse_topology_conf(_text(source, "topology_conf", data["topology_conf"], conf), str(conf))
        sources["switches"] = f"Slurm topology.conf ({conf.name})"
    else:
        if data["switches"] * data["nodes_per_switch"] > MAX_NODES:
            raise ClusterError(source, [JobProblem("switches", data["switches"], f"switches x nodes_per_switch = "
                                                   f"{data['switches'] * data['nodes_per_switch']:,} nodes; "
                                                   f"{TOO_MANY}")])
        switches = {f"leaf{s}": [f"node{s * data['nodes_per_switch'] + i:03d}" for i in range(data["nodes_per_switch"])]
                    for s in range(data["switches"])}
    topo = None
    if "nvidia_smi_topo" in data:
        f = path.parent / data["nvidia_smi_topo"]
        if not f.is_file():
            raise ClusterError(source, [JobProblem("nvidia_smi_topo", data["nvidia_smi_topo"], f"no such file ({f})")])
        topo = parse_nvidia_smi_topo(_text(source, "nvidia_smi_topo", data["nvidia_smi_topo"], f), str(f))
        if "gpus_per_node" in data and data["gpus_per_node"] != topo.gpus:
            raise ClusterError(source, [JobProblem("gpus_per_node", data["gpus_per_node"],
                                                   f"the nvidia-smi matrix ({f.name}) shows {topo.gpus} GPUs")])
        values["gpus_per_node"] = topo.gpus
        sources["gpus_per_node"] = f"nvidia-smi topo -m ({f.name})"
        if "intra_node_gbps" not in data:
            bw, code = topo.bottleneck_gbps(values["nvlink_gbps_per_link"])
            values["intra_node_gbps"] = bw
            sources["intra_node_gbps"] = (f"nvidia-smi topo -m ({f.name}): slowest GPU pair is {code}"
                                          + (f" x {values['nvlink_gbps_per_link']:g} GB/s per link"
                                             if code.startswith("NV") else " (assumed PCIe rate)"))
    n_gpus = sum(len(v) for v in switches.values()) * values["gpus_per_node"]
    if n_gpus > MAX_GPUS:
        raise ClusterError(source, [JobProblem("gpus_per_node", values["gpus_per_node"], f"{n_gpus:,} GPUs in "
                                               f"{n_gpus // values['gpus_per_node']:,} nodes; at most {MAX_GPUS:,} "
                                               "GPUs in a cluster (more than any built)")])
    if values["occupied_gpus"] >= n_gpus:
        raise ClusterError(source, [JobProblem("occupied_gpus", values["occupied_gpus"],
                                               f"must be below the cluster's {n_gpus} GPUs")])
    queue = _queue(values.get("queue") or [], source)
    for i, q in enumerate(queue):
        if q.gpus > n_gpus:
            raise ClusterError(source, [JobProblem(f"queue[{i}].gpus", q.gpus, f"must be <= the cluster's {n_gpus} "
                                                   "GPUs")])
    return Cluster(values.get("name", path.stem), dev.lookup_chip(values["gpu"]).name, float(values["gpu_memory_gb"]),
                   values["gpus_per_node"], switches, float(values["intra_node_gbps"]),
                   float(values["node_network_gbps"]), float(values["oversubscription"]),
                   float(values["intra_node_latency_us"]), float(values["inter_node_latency_us"]),
                   values["occupied_gpus"], queue, sources, topo)
