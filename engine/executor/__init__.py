"""The processes of a tensor-parallel engine: the driver's executor that starts, watches and stops this
host's other ranks (``multiproc_executor``), the zygote they are forked from (``zygote``) a rank's loop
(``worker_main``), and the free ports a rendezvous or a server binds (``ports``)."""
