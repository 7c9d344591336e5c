"""Planning: building simulation setups from a model, a cluster and a layout (:mod:`.setup`), and the
Megatron-LM Table 1 fidelity check through that one path (:mod:`.table1`). Pure Python (no torch)."""
