"""The comparison: the per-leaf records of a check, from live arrays (``live``, its device-side reductions
``_device_stats`` and cheap ``first_pass``, the model's own state ``model_state``) or from a recorded run's
digests (``digest``, one leaf's digest ``leaf_digest``)."""
