"""Neuron alignment shared by OTFusion and PFNM: the channel structure of a network's graph
(:mod:`.graph`) and optimal transport between two models' neurons (:mod:`.transport`)."""
