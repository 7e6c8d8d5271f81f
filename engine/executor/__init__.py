"""The processes of a tensor-parallel engine: the driver's executor that starts, watches and stops this
host's other ranks (``multiproc_executor``), the zygote they are forked from (``zygote``) and a rank's loop
(``worker_main``)."""
