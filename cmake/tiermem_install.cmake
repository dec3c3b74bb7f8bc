# The installed package (README "Link tiermem into your framework"), included last by the top
# CMakeLists.txt:
#   - the library a framework links: libtiermem.a, or libtiermem.so.<major> with
#     -DBUILD_SHARED_LIBS=ON, made of the objects of the libraries below (no second compile; the
#     tools and tests keep linking those libraries). Only TIERMEM_API symbols are visible
#     (tiermem/export.h);
#   - its one target, tiermem::tiermem (also an alias in this tree): the include directory, C++20
#     and the dependencies of those libraries, PUBLIC ones as PUBLIC, the rest PRIVATE (a static
#     libtiermem.a still hands those to its consumers' link);
#   - tiermemConfig.cmake + tiermemConfigVersion.cmake (same major version) for find_package,
#     which find the dependencies again (cmake/tiermemConfig.cmake.in), and tiermem.pc;
#   - the headers of include/tiermem/. The programs install themselves (tiermem_tool).
# tests/install/consumer_test.sh builds examples/zero_mlp.cc against an install, both ways.
include(CMakePackageConfigHelpers)

# The libraries of the package: what include/tiermem/ declares (not the GPT model, the trainer or
# the planner, which serve the tools).
set(TIERMEM_PACKAGE_LIBS core nvme cpu gpu prefetch runtime comm zero train_state)
# Dependencies needed only to compile those libraries (header-only): not linked.
set(TIERMEM_COMPILE_ONLY_DEPS Boost::boost nlohmann_json::nlohmann_json CLI11::CLI11)

add_library(tiermem)
add_library(tiermem::tiermem ALIAS tiermem)
set(tiermem_public_deps)
set(tiermem_private_deps)
foreach(lib IN LISTS TIERMEM_PACKAGE_LIBS)
  target_sources(tiermem PRIVATE $<TARGET_OBJECTS:tiermem_${lib}>)
  get_target_property(all_deps tiermem_${lib} LINK_LIBRARIES)
  get_target_property(public_deps tiermem_${lib} INTERFACE_LINK_LIBRARIES)
  foreach(dep IN LISTS all_deps)
    if(dep MATCHES "^tiermem")
      continue()  # one of the package's own libraries
    elseif(dep IN_LIST public_deps)
      list(APPEND tiermem_public_deps ${dep})
    elseif(NOT dep IN_LIST TIERMEM_COMPILE_ONLY_DEPS)
      list(APPEND tiermem_private_deps ${dep})
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES tiermem_public_deps)
list(REMOVE_DUPLICATES tiermem_private_deps)
list(REMOVE_ITEM tiermem_private_deps ${tiermem_public_deps})
target_link_libraries(tiermem PUBLIC ${tiermem_public_deps} PRIVATE ${tiermem_private_deps})
target_include_directories(tiermem PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                          $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(tiermem PUBLIC cxx_std_20)
set_target_properties(tiermem PROPERTIES LINKER_LANGUAGE CXX EXPORT_NAME tiermem
                      VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR})
get_target_property(tiermem_type tiermem TYPE)
if(tiermem_type STREQUAL "SHARED_LIBRARY")
  set(TIERMEM_SHARED ON)
  # Every undefined symbol resolved when the library is linked, not in a consumer's link.
  target_link_options(tiermem PRIVATE LINKER:--no-undefined)
else()
  set(TIERMEM_SHARED OFF)
endif()

# pkg-config's spelling of each dependency: a module for Requires, or flags for Libs.
set(tiermem_pc_requires)
set(tiermem_pc_requires_private)
set(tiermem_pc_libs)
set(tiermem_pc_libs_private)
foreach(dep IN LISTS tiermem_public_deps tiermem_private_deps)
  set(module "")
  set(flags "")
  if(dep STREQUAL "spdlog::spdlog")
    set(module spdlog)
  elseif(dep STREQUAL "fmt::fmt")
    set(module fmt)
  elseif(dep STREQUAL "nlohmann_json::nlohmann_json")
    set(module nlohmann_json)
  elseif(dep MATCHES "^PkgConfig::(.*)$")
    set(module ${${CMAKE_MATCH_1}_MODULE_NAME})  # pkg_check_modules(<X> ...) sets <X>_MODULE_NAME
  elseif(dep STREQUAL "Threads::Threads")
    set(flags -pthread)
  elseif(dep STREQUAL "OpenMP::OpenMP_CXX")
    set(flags ${OpenMP_CXX_FLAGS})
  elseif(dep STREQUAL "MPI::MPI_CXX")
    list(JOIN MPI_CXX_LIBRARIES " " flags)
  elseif(dep STREQUAL "CUDA::cudart")
    set(flags "-L${CUDAToolkit_LIBRARY_DIR} -lcudart")
  elseif(dep STREQUAL "NCCL::nccl")
    set(flags ${NCCL_LIBRARY})
  else()
    message(FATAL_ERROR "cmake/tiermem_install.cmake: no pkg-config spelling for the dependency "
                        "${dep} of the installed library; add one to the list above")
  endif()
  # A shared library has linked its private dependencies; a static one hands them on.
  if(dep IN_LIST tiermem_private_deps AND TIERMEM_SHARED)
    list(APPEND tiermem_pc_requires_private ${module})
    list(APPEND tiermem_pc_libs_private ${flags})
  else()
    list(APPEND tiermem_pc_requires ${module})
    list(APPEND tiermem_pc_libs ${flags})
  endif()
endforeach()
list(REMOVE_DUPLICATES tiermem_pc_libs)
list(REMOVE_DUPLICATES tiermem_pc_libs_private)
list(JOIN tiermem_pc_requires ", " TIERMEM_PC_REQUIRES)
list(JOIN tiermem_pc_requires_private ", " TIERMEM_PC_REQUIRES_PRIVATE)
list(JOIN tiermem_pc_libs " " TIERMEM_PC_LIBS)
list(JOIN tiermem_pc_libs_private " " TIERMEM_PC_LIBS_PRIVATE)
# tiermem.pc names its prefix relative to itself, so an install moved or made with
# `cmake --install --prefix DIR` stays right.
file(RELATIVE_PATH TIERMEM_PC_PREFIX_FROM_PCDIR "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
string(REGEX REPLACE "/$" "" TIERMEM_PC_PREFIX_FROM_PCDIR "${TIERMEM_PC_PREFIX_FROM_PCDIR}")
configure_file(${CMAKE_CURRENT_LIST_DIR}/tiermem.pc.in ${PROJECT_BINARY_DIR}/tiermem.pc @ONLY)

set(TIERMEM_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/tiermem)
if(TIERMEM_HAVE_NCCL)
  get_filename_component(NCCL_LIBRARY_DIR ${NCCL_LIBRARY} DIRECTORY)  # a hint for the config
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/tiermemConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tiermemConfig.cmake INSTALL_DESTINATION ${TIERMEM_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tiermemConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)

install(TARGETS tiermem EXPORT tiermemTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/tiermem DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(EXPORT tiermemTargets NAMESPACE tiermem:: DESTINATION ${TIERMEM_CMAKE_DIR})
install(FILES ${PROJECT_BINARY_DIR}/tiermemConfig.cmake ${PROJECT_BINARY_DIR}/tiermemConfigVersion.cmake
  DESTINATION ${TIERMEM_CMAKE_DIR})
install(FILES ${PROJECT_BINARY_DIR}/tiermem.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
