"""Pure rank arithmetic: which global rank sits in which parallel group.

No ``torch.distributed`` here; everything is integer arithmetic, testable without processes.

The world is cut twice over the same ranks, as Megatron-core's ``initialize_model_parallel`` does:

* the *decoder* decomposition ``tp × cp × dp × pp`` (with ep = 1), used by attention and dense
  layers, where ``dp = world / (tp·pp·cp)``;
* the *expert* decomposition ``etp × ep × edp × pp`` (with cp = 1), used by MoE layers, where
  ``etp`` defaults to ``tp`` and ``edp = world / (etp·ep·pp)``.

Both use the same order string, which lists the dimensions fastest-varying first. For the
default ``"tp-cp-ep-dp-pp"`` a global rank is the mixed-radix number

    rank = tp_rank + tp·(cp_rank + cp·(ep_rank + ep·(dp_rank + dp·pp_rank)))

A group of kind ``"x-y"`` holds the ranks that differ only in their x and y coordinates; inside a
group the ranks follow the order string (fastest dimension first), never the order in which the
name is spelled, so every group is sorted ascending. Groups are listed by the remaining
(unmasked) coordinates, again fastest dimension first. This reproduces Megatron-core 0.16's
``RankGenerator.get_ranks`` for the same sizes and order.

Worked example, world 8, tp 2, pp 2 (so dp 2)::

    tp: [0,1] [2,3] [4,5] [6,7]     dp: [0,2] [1,3] [4,6] [5,7]     pp: [0,4] [1,5] [2,6] [3,7]
"""
from __future__ import annotations

from tpfuse.parallel.checks import (check_int_at_least, check_int_at_least_or_none,
                                    check_int_in_range)

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")

# Group name -> (decomposition, tokens of that decomposition's order string).
# In the expert decomposition the tokens "tp" and "dp" stand for etp and edp.
_GROUP_TOKENS = {
    "tp": ("decoder", ("tp",)),
    "pp": ("decoder", ("pp",)),
    "dp": ("decoder", ("dp",)),
    "cp": ("decoder", ("cp",)),
    "dp-cp": ("decoder", ("dp", "cp")),
    "tp-pp": ("decoder", ("tp", "pp")),
    "tp-dp": ("decoder", ("tp", "dp")),
    "tp-cp": ("decoder", ("tp", "cp")),
    "tp-dp-cp": ("decoder", ("tp", "dp", "cp")),
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "etp-ep": ("expert", ("tp", "ep")),
    "etp-ep-pp": ("expert", ("tp", "ep", "pp")),
    "edp": ("expert", ("dp",)),
}
GROUP_NAMES = tuple(_GROUP_TOKENS) + ("embedding", "position-embedding")


def _check_size(name: str, value) -> int:
    return check_int_at_least(name, value, 1)


def parse_order(order: str, sizes: dict[str, int], side: str) -> tuple[str, ...]:
    """Tokens of ``order`` (fastest first), size-1 dimensions missing from it appended.

    ``sizes`` maps each token to its size in one decomposition; ``side`` names that
    decomposition in error messages ("decoder" or "expert").
    """
    if not isinstance(order, str):
        raise ValueError(f"order must be a string like {DEFAULT_ORDER!r}, got {order!r}")
    tokens = order.lower().split("-")
    for token in tokens:
        if token not in ORDER_TOKENS:
            raise ValueError(f"order {order!r} has unknown token {token!r}; "
                             f"known tokens: {'-'.join(ORDER_TOKENS)}")
        if tokens.count(token) > 1:
            raise ValueError(f"order {order!r} repeats token {token!r}")
    missing = [t for t in ORDER_TOKENS if t not in tokens]
    for token in missing:
        if sizes[token] > 1:
            label = {"expert": {"tp": "etp", "dp": "edp"}}.get(side, {}).get(token, token)
            raise ValueError(f"order {order!r} lacks {token!r} but {label}={sizes[token]} > 1 "
                             f"({side} side); every dimension of size > 1 must be in the order")
    return tuple(tokens) + tuple(missing)


def check_vpp(vpp, pp: int):
    """Validate a virtual pipeline size (None = no interleaving); returns it."""
    if vpp is None:
        return None
    check_int_at_least_or_none("vpp (virtual pipeline size)", vpp, 1)
    if pp == 1:
        raise ValueError(f"vpp={vpp} needs pipeline parallelism, but pp=1 "
                         f"(an interleaved schedule needs pp > 1)")
    return vpp


def _offsets(dims: list[tuple[int, int]]) -> list[int]:
    """All sums Σ i_k·stride_k over (size_k, stride_k) in ``dims``, first dimension fastest."""
    offsets = [0]
    for size, stride in dims:
        offsets = [base + i * stride for i in range(size) for base in offsets]
    return offsets


def orthogonal_groups(tokens: tuple[str, ...], sizes: dict[str, int],
                      members: tuple[str, ...]) -> list[list[int]]:
    """Groups spanning the dimensions ``members`` in the mixed-radix layout ``tokens``.

    Rank = Σ coord_t · stride_t with stride_t = Π sizes of the tokens before t. One group per
    combination of the other coordinates (first token fastest); inside a group the member
    coordinates vary, first token fastest, so each group is ascending.
    """
    strides, stride = {}, 1
    for token in tokens:
        strides[token] = stride
        stride *= sizes[token]
    inner = [(sizes[t], strides[t]) for t in tokens if t in members]
    outer = [(sizes[t], strides[t]) for t in tokens if t not in members]
    member_offsets = _offsets(inner)
    return [[base + off for off in member_offsets] for base in _offsets(outer)]


def _digits(rank: int, tokens: tuple[str, ...], sizes: dict[str, int]) -> dict[str, int]:
    """Coordinates of ``rank`` in the mixed radix ``tokens`` (first token fastest)."""
    digits = {}
    for token in tokens:
        rank, digits[token] = divmod(rank, sizes[token])
    return digits


INSTANCE_GROUP_NAMES = ("intra-dp-cp", "inter-dp-cp", "intra-edp", "inter-edp")
_INSTANCE_BASES = {"dp-cp": ("intra-dp-cp", "inter-dp-cp"), "edp": ("intra-edp", "inter-edp")}


def split_into_instances(groups: list[list[int]], instances: int) -> tuple[list, list]:
    """Megatron's distributed-optimizer instances (``--num-distributed-optimizer-instances``):
    each data-parallel group of n ranks (dp x cp, or expert dp) is cut into ``instances``
    consecutive blocks of s = n / instances ranks, the *intra* groups (one optimizer instance
    each: the shards), and the ranks at the same place of every block form the *inter* groups
    (the replicas of one shard)::

        group [r_0 ... r_{n-1}]:   intra_i = [r_{i·s} ... r_{i·s+s-1}]   inter_j = [r_j, r_{j+s}, ...]

    Megatron-core's ``create_hierarchical_groups(ranks, [s, instances])`` levels 0 and 1."""
    intra, inter = [], []
    for ranks in groups:
        if len(ranks) % instances:
            raise ValueError(f"--num-distributed-optimizer-instances {instances} must divide "
                             f"the data-parallel group of {len(ranks)} ranks {ranks}")
        size = len(ranks) // instances
        intra += [ranks[i * size:(i + 1) * size] for i in range(instances)]
        inter += [ranks[j::size] for j in range(size)]
    return intra, inter


def instance_groups(layout: "RankLayout", name: str, instances: int) -> list[list[int]]:
    """Every group of kind ``name`` (one of ``INSTANCE_GROUP_NAMES``) of ``layout`` split into
    ``instances`` (``split_into_instances`` of its dp-cp or edp groups)."""
    for base, (intra_name, inter_name) in _INSTANCE_BASES.items():
        if name in (intra_name, inter_name):
            intra, inter = split_into_instances(layout.groups(base), instances)
            return intra if name == intra_name else inter
    raise ValueError(f"unknown instance group name {name!r}; known: "
                     f"{', '.join(INSTANCE_GROUP_NAMES)}")


def instance_group_of(layout: "RankLayout", name: str, instances: int, rank: int) -> list[int]:
    """The group of kind ``name`` (``instance_groups``) holding ``rank``."""
    return next(g for g in instance_groups(layout, name, instances) if rank in g)


def check_distributed_optimizer_instances(instances, dp_cp: int, edp: int) -> int:
    """``--num-distributed-optimizer-instances``: an int >= 1 dividing the data-parallel
    (dp x cp) size and the expert data-parallel size (Megatron's asserts); returns it."""
    check_int_at_least("--num-distributed-optimizer-instances", instances, 1)
    for label, size in (("data-parallel (dp x cp)", dp_cp), ("expert data-parallel", edp)):
        if size % instances:
            raise ValueError(f"--num-distributed-optimizer-instances {instances} must divide "
                             f"the {label} size {size}")
    return instances


class RankLayout:
    """The rank arithmetic of one parallel configuration.

    ``RankLayout(world_size, tp=1, pp=1, cp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp")``;
    sizes ``.tp .pp .dp .cp .ep .etp .edp``; ``.groups(name)``, ``.group_of(name, rank)``,
    ``.rank_in(name, rank)``, ``.coords(rank)``, ``.to_dict()``. Group names: ``GROUP_NAMES``.
    """

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None, order: str = DEFAULT_ORDER):
        self.world_size = _check_size("world_size", world_size)
        self.tp, self.pp = _check_size("tp", tp), _check_size("pp", pp)
        self.cp, self.ep = _check_size("cp", cp), _check_size("ep", ep)
        self.etp = self.tp if etp is None else _check_size("etp", etp)
        self.dp = self._quotient("tp*pp*cp", tp * pp * cp, f"tp={tp}, pp={pp}, cp={cp}")
        self.edp = self._quotient("etp*ep*pp", self.etp * ep * pp,
                                  f"etp={self.etp}, ep={ep}, pp={pp}")
        self._decoder_sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        self._expert_sizes = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp,
                              "pp": self.pp}
        self.order = order.lower() if isinstance(order, str) else order
        self._decoder_tokens = parse_order(order, self._decoder_sizes, "decoder")
        self._expert_tokens = parse_order(order, self._expert_sizes, "expert")
        self._check_pipelines_agree()
        self._groups: dict[str, list[list[int]]] = {}
        self._group_by_rank: dict[str, list] = {}   # name -> [rank's group (shared) per rank]

    def _quotient(self, label: str, product: int, values: str) -> int:
        if self.world_size % product:
            raise ValueError(f"world_size={self.world_size} is not divisible by "
                             f"{label}={product} ({values})")
        return self.world_size // product

    def _check_pipelines_agree(self) -> None:
        if self.pp > 1 and not self.order.endswith("pp") and self.edp != self.dp:
            raise ValueError(
                f"order {self.order!r} does not end in 'pp' with pp={self.pp} > 1, so the expert "
                f"data-parallel size must equal the data-parallel size: edp={self.edp}, "
                f"dp={self.dp}")
        decoder = orthogonal_groups(self._decoder_tokens, self._decoder_sizes, ("pp",))
        expert = orthogonal_groups(self._expert_tokens, self._expert_sizes, ("pp",))
        if decoder != expert:
            raise ValueError(
                f"order {self.order!r} gives different pipeline groups on the decoder side "
                f"(tp={self.tp}, cp={self.cp}) and the expert side (etp={self.etp}, ep={self.ep})"
                f": {decoder} vs {expert}; put 'pp' last")

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp,
                "ep": self.ep, "etp": self.etp, "edp": self.edp}

    def groups(self, name: str) -> list[list[int]]:
        """Every group of kind ``name`` as lists of global ranks (a fresh copy)."""
        if name not in self._groups:
            self._groups[name] = self._build_groups(name)
        return [list(group) for group in self._groups[name]]

    def _build_groups(self, name: str) -> list[list[int]]:
        if name in ("embedding", "position-embedding"):
            pipelines = self.groups("pp")
            if name == "position-embedding":
                return [[ranks[0]] for ranks in pipelines]
            return [[ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]]
                    for ranks in pipelines]
        if name not in _GROUP_TOKENS:
            raise ValueError(f"unknown group name {name!r}; known: {', '.join(GROUP_NAMES)}")
        side, members = _GROUP_TOKENS[name]
        if side == "decoder":
            return orthogonal_groups(self._decoder_tokens, self._decoder_sizes, members)
        return orthogonal_groups(self._expert_tokens, self._expert_sizes, members)

    def _check_rank(self, rank: int) -> int:
        return check_int_in_range("rank", rank, 0, self.world_size)

    def group_view(self, name: str, rank: int) -> list[int] | None:
        """Like ``group_of`` but the layout's own list (read only; no copy): O(1) per call after
        one O(world) pass per group kind, so a table over every rank is linear in world size."""
        self._check_rank(rank)
        if name not in self._group_by_rank:
            self.groups(name)                      # builds (and validates) the kind
            table = [None] * self.world_size
            for group in self._groups[name]:
                for member in group:
                    table[member] = group
            self._group_by_rank[name] = table
        return self._group_by_rank[name][rank]

    def group_of(self, name: str, rank: int) -> list[int] | None:
        """The group of kind ``name`` holding ``rank`` (None: an embedding group it is not in)."""
        group = self.group_view(name, rank)
        return None if group is None else list(group)

    def rank_in(self, name: str, rank: int) -> int | None:
        """Position of ``rank`` inside its group of kind ``name`` (None if it is in none)."""
        group = self.group_of(name, rank)
        return None if group is None else group.index(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """Every per-dimension rank of one global rank: the digits of ``rank`` in the mixed radix
        of each decomposition, ``(rank // stride_t) % size_t``."""
        self._check_rank(rank)
        decoder = _digits(rank, self._decoder_tokens, self._decoder_sizes)
        expert = _digits(rank, self._expert_tokens, self._expert_sizes)
        return {"rank": rank, "tp": decoder["tp"], "cp": decoder["cp"], "dp": decoder["dp"],
                "pp": decoder["pp"], "ep": expert["ep"], "etp": expert["tp"], "edp": expert["dp"]}

    def to_dict(self) -> dict:
        """Everything about the layout as plain JSON-able data."""
        return {
            "world_size": self.world_size,
            "order": self.order,
            "sizes": self.sizes,
            "ranks": [self.coords(rank) for rank in range(self.world_size)],
            "groups": {name: self.groups(name) for name in GROUP_NAMES},
        }

    def __repr__(self) -> str:
        return (f"RankLayout(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, "
                f"cp={self.cp}, ep={self.ep}, etp={self.etp}, order={self.order!r})")

    def __eq__(self, other) -> bool:
        return isinstance(other, RankLayout) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))
