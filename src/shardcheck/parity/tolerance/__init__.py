"""Tolerance: how far a correct candidate may differ from the reference, per leaf and step. The default rule
(``derive``), the precision policy (``precision``) and the matmul precision a backend really uses (``matmul``),
the accumulated allowances (``allowances``) and their propagation through an optimizer (``propagation``), per-leaf
overrides (``overrides``) and the re-check at ``"highest"`` (``recheck``)."""
