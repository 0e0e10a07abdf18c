"""Adversarial shift: gradient attacks on pixels and the Voronoi-epsilon adversarial accuracy.

- :mod:`~shiftguard.adversarial.attacks` -- :func:`fgsm` (Goodfellow et al. 2015), :func:`bim`
  (Kurakin et al. 2017), :func:`pgd` (Madry et al. 2018) under L-inf or L2 budgets, untargeted or
  targeted, against logits or, through any training loss, embeddings [NED, Sec. 5];
  :class:`AttackSpec` names one of them (``"pgd-linf"``) for a shift grid whose severity is ``eps``.
- :mod:`~shiftguard.adversarial.voronoi` -- the Voronoi-epsilon adversary [Kim, Art. III, Def. 3]:
  :func:`voronoi_project`, :func:`voronoi_pgd`, :func:`voronoi_adversarial_accuracy`,
  :func:`standard_adversarial_accuracy` [Kim, Art. III, Def. 2], :func:`global_voronoi_robustness`
  [Kim, Art. III, Def. 4] and :func:`voronoi_inner_radius` [Kim, Art. III, Observation 1].

Images are pixels (``uint8``, or float in [0, 1]); ``preprocess`` runs between them and the model.
See ``docs/adversarial.md``.
"""

from shiftguard.adversarial.attacks import ATTACK_NAMES, NORMS, AttackSpec, bim, fgsm, pgd
from shiftguard.adversarial.voronoi import (
    global_voronoi_robustness,
    standard_adversarial_accuracy,
    voronoi_adversarial_accuracy,
    voronoi_inner_radius,
    voronoi_pgd,
    voronoi_project,
)

__all__ = [
    "ATTACK_NAMES",
    "NORMS",
    "AttackSpec",
    "bim",
    "fgsm",
    "global_voronoi_robustness",
    "pgd",
    "standard_adversarial_accuracy",
    "voronoi_adversarial_accuracy",
    "voronoi_inner_radius",
    "voronoi_pgd",
    "voronoi_project",
]
