"""Tandem's paged-attention inference engine.

OpenMP's wait policy must be chosen before torch (libgomp) is loaded, so it is
chosen here, on the first import of the package: ``engine.worker.device.
choose_omp_wait_policy`` (spin briefly on cores the engine has to itself,
sleep at once on a busy machine; ``TANDEM_CPU_WAIT_POLICY`` and the OpenMP
variables override it). The engine core process inherits the choice.
"""

from engine.worker.device import choose_omp_wait_policy

CPU_WAIT_POLICY = choose_omp_wait_policy()   # "spin", "passive" or "user"; logged when the engine is ready
