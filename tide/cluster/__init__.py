"""Slurm: the heterogeneous job's script (one pure function of the config), every Slurm command
call, and the submitit executor for het jobs."""
