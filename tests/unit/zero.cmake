# ZeRO partitioner: shard arithmetic, loss scaler, ZeroEngine on one rank (tests/mpi runs it on 2, 4).
tiermem_test(NAME zero_test SOURCES shard_test.cc loss_scaler_test.cc zero_engine_test.cc
             zero_device_test.cc zero_device_optimizer_test.cc zero_frozen_test.cc zero_single_copy_test.cc
             zero_backward_step_test.cc zero_frozen_at_rest_test.cc
             DEPS tiermem::zero nlohmann_json::nlohmann_json TIMEOUT 120 LABELS zero)
# ZeroEngine's parts, each tested directly (src/zero/: partition_layout, norm_fold, deferred_updates,
# tier_setup, reduce_bucket, step_io_meter; the owned parts gatherer, gradient_reducer, norm_tracker,
# device_staging, working_shard_out, update_scheduler over the fakes of zero_parts_fakes.h).
tiermem_test(NAME zero_parts_test SOURCES zero_partition_layout_test.cc zero_norm_fold_test.cc
             zero_deferred_updates_test.cc zero_tier_setup_test.cc zero_reduce_bucket_test.cc
             zero_gatherer_test.cc zero_gradient_reducer_test.cc zero_norm_tracker_test.cc
             zero_device_staging_test.cc zero_working_shard_out_test.cc zero_step_io_meter_test.cc
             zero_update_scheduler_test.cc
             DEPS tiermem::zero TIMEOUT 60 LABELS zero)
