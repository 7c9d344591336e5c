"""The planner: partition, device mapping, recomputation and schedule choice, and the search over them
(Luo et al., INFOCOM 2022; docs/planner.md). Pure Python."""
