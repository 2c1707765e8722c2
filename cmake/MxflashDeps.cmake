# Locates the header-only dependencies the set-up script installs from PyPI, through the Python
# that installed them: CUTLASS/CuTe (nvidia-cutlass) and the cuDNN frontend (nvidia-cudnn-frontend).
find_package(Python3 COMPONENTS Interpreter)
set(MXFLASH_CUTLASS_INCLUDE "" CACHE PATH "CUTLASS/CuTe include dir (found automatically)")
set(MXFLASH_CUDNN_FE_INCLUDE "" CACHE PATH "cudnn-frontend include dir (found automatically)")
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    OUTPUT_VARIABLE _mxf_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT MXFLASH_CUTLASS_INCLUDE AND EXISTS "${_mxf_site}/cutlass_library/source/include/cute/tensor.hpp")
    set(MXFLASH_CUTLASS_INCLUDE "${_mxf_site}/cutlass_library/source/include" CACHE PATH "" FORCE)
  endif()
  if(NOT MXFLASH_CUDNN_FE_INCLUDE AND EXISTS "${_mxf_site}/include/cudnn_frontend.h")
    set(MXFLASH_CUDNN_FE_INCLUDE "${_mxf_site}/include" CACHE PATH "" FORCE)
  endif()
endif()
message(STATUS "mxflash: CUTLASS headers: ${MXFLASH_CUTLASS_INCLUDE}")
message(STATUS "mxflash: cudnn-frontend headers: ${MXFLASH_CUDNN_FE_INCLUDE}")
