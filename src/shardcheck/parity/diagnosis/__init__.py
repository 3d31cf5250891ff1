"""Diagnosis: from the per-leaf records to a named cause. The records and the catalog of rules (``rules``), the
hypothesis reruns that name a faulty reduction (``hypotheses``), the scale evidence (``scale_evidence``) and the
mesh topology faults (``topology``)."""
