"""Speed and memory benchmarks of the VAE trainer and its input pipeline (`python bench.py`; its --help, bench/cli.py's
docstring, documents the sections and the headline keys of --json). One module per section of --sections:

    data  train  memory  finetune  gpu  quality  latents  decoders  decoder_quality  resolutions  copies  precision
    video  video_critic  video_decode  video_chunks  families  sharding  memory_check  cuda  tae

and the modules they share:

    cli      the command line: the flags, the run of the named sections, the headline keys and their targets
    harness  the benchmark's configurations; the real Trainer built around in-memory batches; the reference
             trainer's habits; timed, interleaved and FLOP-counted steps
    images   generated photo-like images and their PNG and JPEG shards
    runs     real commands (vae_trainer.py, export.py, evaluate.py) as logged child processes
    report   the human tables and the numbers' formatting
    machine  the CPU, this process's memory, a device's synchronize

and one that runs alone, against this checkout's data.py or an earlier one's:

    mixing   how well the training stream mixes its shards (`python bench/mixing.py [--code DIR]`)
"""
