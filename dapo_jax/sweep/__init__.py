"""Sweeps: many runs of one config, their settings searched by optuna and stopped early by its pruners,
reported with spread over seeds. `space` (what is searched) < `trials` (one run's process and curve)
< `study` (the optuna study that drives them) ; `report` (the table and plot). `launch.sweep` and
`launch.ablate` build them from a config file (`builders.sweep`)."""
