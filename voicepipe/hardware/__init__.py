"""Hardware models of LLM serving: catalog (devices, models), analytic timing, shared-device simulation.

* :mod:`~voicepipe.hardware.catalog` — devices, models and serving stacks with the source of every number
* :mod:`~voicepipe.hardware.byo` — a user's own Hugging Face ``config.json`` or device YAML
* :mod:`~voicepipe.hardware.model` — pure timing functions (roofline for HBM, per-layer + hops for SRAM)
* :mod:`~voicepipe.hardware.serving` — one shared device on virtual time (continuous batching, queue)
* :mod:`~voicepipe.hardware.validate` — fit of the few global constants, leave-one-source-out residuals

The backend a stage awaits is :mod:`voicepipe.backends.hardware` (``make_hardware_backend(spec)``); the
published calibration points of docs/reference-figures.md are recomputed by :mod:`voicepipe.backends.reference`.
Nothing in this package imports from outside it except the base layers (clock, errors, limits, text).
"""
