"""FAM (forgetting-aware minimisation): MISA's SAM variant for its initial session adaptation.

SAM takes the ascent step on the *same* batch's loss, to find a flat minimum of it. FAM takes the ascent step
on the loss of an *out-of-session* batch (classes the session never trains on) and the descent step on the
current batch's loss at that perturbed point: the update is chosen so that the current session's loss stays
low even when the weights move in the direction that hurts other classes most, which is what makes the warmed
prompts a good start for later, unknown tasks.

One update, with w the trainable parameters and rho the radius:

1. backprop the out-of-session loss; ``first_step``: remember w, move to ``w + rho * g / ||g||`` where ``||g||``
   is the global L2 norm over every parameter with a gradient (MISA's ``optim/fam.py``: one norm over all
   parameter groups, not per tensor; parameters without a gradient stay where they are);
2. backprop the current batch's loss at the perturbed point; ``second_step``: restore w and let the base
   optimizer (Adam in MISA) step with that gradient.

Example (plain SGD as the base, a linear out-of-session loss with gradient (3, 4), so ||g|| = 5):
    >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    >>> fam = FAM(torch.optim.SGD([w], lr=0.25), rho=2.5)
    >>> (w @ torch.tensor([3.0, 4.0])).backward()
    >>> fam.first_step()                      # w + 2.5 * (3, 4) / 5
    >>> w.detach()
    tensor([2.5000, 0.0000])
    >>> (w ** 2).sum().backward()             # current loss' gradient at the perturbed point: (5, 0)
    >>> fam.second_step()                     # back to (1, -2), then SGD: (1, -2) - 0.25 * (5, 0)
    >>> w.detach()
    tensor([-0.2500, -2.0000])
"""

from __future__ import annotations

import torch


class FAM:
    """Two-step forgetting-aware update around ``base`` (any torch optimizer; its parameter groups are used)."""

    def __init__(self, base: torch.optim.Optimizer, rho: float = 0.1):
        if rho < 0:
            raise ValueError(f"rho must be non-negative, got {rho}")
        self.base, self.rho = base, rho
        self._saved: dict[torch.nn.Parameter, torch.Tensor] = {}

    def params_with_grad(self) -> list[torch.nn.Parameter]:
        return [p for group in self.base.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def first_step(self) -> None:
        """Save the weights and move every parameter with a gradient by ``rho * g / ||g||``; clears the grads."""
        params = self.params_with_grad()
        if not params:
            raise RuntimeError("FAM.first_step: no parameter has a gradient (call backward on the out-of-session "
                               "loss first)")
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))  # scalar
        scale = self.rho / (norm + 1e-12)
        self._saved = {p: p.detach().clone() for p in params}
        for p in params:
            p.add_(p.grad * scale.to(p))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        """Restore the saved weights, then step the base optimizer with the gradient taken at the perturbed point."""
        if not self._saved:
            raise RuntimeError("FAM.second_step without first_step")
        for p, saved in self._saved.items():
            p.copy_(saved)
        self._saved = {}
        self.base.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.base.zero_grad(set_to_none=True)
