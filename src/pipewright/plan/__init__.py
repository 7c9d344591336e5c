"""The planner: partition, device mapping, recomputation and schedule choice, and the search over them
(Luo et al., INFOCOM 2022; docs/planner.md); the one builder of simulation setups from a model, a cluster
and a layout (:mod:`.setup`), and Megatron-LM Table 1 predicted through it (:mod:`.table1`). Pure Python."""
