"""The executor core: a rank's stages, the pipeline executor and its handlers, point-to-point transfers,
the training-plugin protocol, the Trainer and its step loop, precision, recomputation and compilation."""
