"""The parallel dimensions beyond the pipeline: the (tp, cp, pp, dp) process mesh, tensor parallelism
(:mod:`.tp`), context parallelism (:mod:`.cp`), expert parallelism for mixture-of-experts
(``moe_*``), data-parallel gradient buckets, ZeRO-1 and the tied embedding."""
