"""The boundary with TRL: every private TRL name, patch and assumption this package relies on, one module per surface.

* :mod:`.base`: :class:`TrlInternalsChanged` (raised by every failed check, naming the installed TRL version),
  :func:`inherited_method` (the method a trainer really inherits, not what ``trl.GRPOTrainer`` is bound to now),
  :func:`require_parameters` (its signature, checked) and :func:`require_hooks` (the private methods a trainer
  overrides, still defined by TRL);
* :mod:`.grpo`: ``GRPOTrainer``'s private methods, called through small checked functions (generation, scoring, the
  forward, the checkpoint), and what is read from them (the generation result, the forward's signature, the loss
  types that divide by the kept-token count, the checkpoint directory, TRL's pi_old condition);
* :mod:`.grpo_forwards`: TRL's calls to ``_get_per_token_logps_and_entropies``, answered from an explicit plan;
* :mod:`.async_grpo`: ``AsyncGRPOTrainer``'s loss (its micro-batch keys, its one forward on the packed row, its
  forward timer) and weight sync;
* :mod:`.async_grpo_data`: the rollout queue dataset and collator, which carry every sample's policy version;
* :mod:`.async_grpo_cpu`: the async trainer's CPU support (tree attention, MFU probe);
* :mod:`.vllm`: TRL's vLLM client and engine construction, its weight-sync parameters, the methods replaced on the
  trainer's ``vllm_generation`` object (``sync_weights``, ``generate``) and its client's requests session.

Nothing outside this package reads TRL's private names or patches TRL's modules or objects
(``tests/repo/test_trl_boundary.py`` checks it). Written against TRL 1.16 (:data:`TESTED_TRL`).
"""

from .base import TESTED_TRL, TrlInternalsChanged, inherited_method

__all__ = ["TESTED_TRL", "TrlInternalsChanged", "inherited_method"]
