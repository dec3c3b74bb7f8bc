# ZeRO partitioner: shard arithmetic, loss scaler, ZeroEngine on one rank (tests/mpi runs it on 2, 4).
tiermem_test(NAME zero_test SOURCES shard_test.cc loss_scaler_test.cc zero_engine_test.cc
             zero_device_test.cc zero_device_optimizer_test.cc
             DEPS tiermem::zero nlohmann_json::nlohmann_json TIMEOUT 120 LABELS zero)
