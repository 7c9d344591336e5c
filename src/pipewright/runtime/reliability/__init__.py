"""Fault handling (docs/reliability.md): hang reports, bounded waits, non-finite checks, preemption and
Ctrl-C, elastic restart, fault injection, and the run guard that holds them."""
