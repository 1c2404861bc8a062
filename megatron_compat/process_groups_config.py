"""megatron-core 0.16's ``process_groups_config.ProcessGroupCollection``: named process groups
handed to a component instead of parallel_state's. Here a plain holder of Megatron's field
names (None until set); tpfuse's compat components use parallel_state's groups and refuse a
``pg_collection=`` argument, naming it."""
from __future__ import annotations

GROUP_FIELDS = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "hcp", "ep", "expt_tp",
                "tp_ep", "tp_ep_pp", "tp_dp_cp", "dp", "dp_cp", "expt_dp", "intra_dp_cp",
                "intra_expt_dp", "inter_dist_opt")


class ProcessGroupCollection:
    def __init__(self, **groups):
        unknown = sorted(set(groups) - set(GROUP_FIELDS))
        if unknown:
            raise TypeError(f"ProcessGroupCollection got unknown groups {unknown}")
        for name in GROUP_FIELDS:
            setattr(self, name, groups.get(name))
