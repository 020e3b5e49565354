"""torch.distributed plumbing below both the trainer and the weight transfer: the device rule of every
tensor collective (:mod:`~mars_megatron.comm.collectives`) and a rendezvous store that listens on one
address only (:mod:`~mars_megatron.comm.tcp_store`).

Why a layer of its own: :mod:`mars_megatron.transfer` (built on by the trainer and the engines alike) needs
both, so they cannot live in :mod:`mars_megatron.training`, which imports the transfer.
"""
