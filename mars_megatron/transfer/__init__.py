"""Trainer → rollout-engine weight transfer by collective broadcast, bucket by bucket.

- :mod:`.plan`: which HF tensors travel together, from which trainer rank, in which order (pure);
- :mod:`.group`: standalone NCCL/gloo groups of one sender and every engine worker of a policy;
- :mod:`.channel`: the sending and the receiving loop, each holding at most two buckets.

Imports only torch and :mod:`mars_megatron.comm.collectives`' device rule: the trainer
(:mod:`mars_megatron.training.weight_sync`) and the engines (:mod:`mars_megatron.rollout`) both build on it.
"""
