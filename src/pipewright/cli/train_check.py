"""``pipewright train --dry-run``: every check ``train`` runs before it starts workers, and the size
estimate (:mod:`pipewright.runtime.setup.size_check`), without starting any."""

from __future__ import annotations


def dry_run(config, profile: str | None = None) -> int:
    """Prepare the run (and read ``profile``, the ``--compare-sim`` profile) and print the estimate."""
    from pipewright.runtime.setup.launch import default_backend
    from pipewright.runtime.setup.size_check import check_fits
    from pipewright.training import prepare

    if profile is not None:
        from pipewright.cost.profiled import load_profile

        load_profile(profile)
    run = prepare(config)  # refuses (one line) what cannot run, including what does not fit
    est = check_fits(run, cpu=default_backend() == "gloo")
    where = run.out_dir if config.out else f"a new folder like {run.out_dir}"
    print(
        f"ok: {run.spec.name}, {run.schedule.name} over tp={config.tp} pp={config.pp} dp={config.dp}"
        + (f" cp={config.cp}" if config.cp > 1 else "")
        + ", "
        f"{config.steps} steps into {where}"
    )
    print(est.describe())
    if config.gpu is not None:
        print(planned_fit(max(est.rank_bytes), config.gpu))
    print("no worker started (--dry-run)")
    return 0


def planned_fit(peak_bytes: float, gpu: str) -> str:
    """Whether a process's estimated peak fits the memory of the accelerator the run is planned for."""
    from pipewright.hardware import accelerator

    memory = accelerator(gpu).memory_bytes
    fits = "fits" if peak_bytes <= memory else "does not fit"
    return f"{fits} a {gpu} ({memory / 2**30:.0f} GiB) per process, by this estimate"
