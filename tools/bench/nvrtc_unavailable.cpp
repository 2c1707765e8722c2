// NOTES: cudnn-frontend's experimental SM100 RmsNorm+SiLU engine references NVRTC, so every binary
// that includes cudnn_frontend.h needs these symbols at link time. mxflash-bench never builds that
// engine (cuDNN's own runtime-compiled engines load NVRTC themselves), so rather than adding
// libnvrtc to what must be carried to the GPU machine, the few entry points report an error here.
// Hidden visibility keeps them out of the dynamic symbol table: they cannot interpose a real NVRTC
// that a library loads.
#define MXF_NVRTC_UNAVAILABLE extern "C" __attribute__((visibility("hidden"))) int

namespace {
constexpr int kNvrtcErrorInternal = 11;  // NVRTC_ERROR_INTERNAL_ERROR
}

MXF_NVRTC_UNAVAILABLE nvrtcCreateProgram(void**, const char*, const char*, int, const char* const*,
                                         const char* const*) {
  return kNvrtcErrorInternal;
}
MXF_NVRTC_UNAVAILABLE nvrtcDestroyProgram(void**) { return kNvrtcErrorInternal; }
MXF_NVRTC_UNAVAILABLE nvrtcCompileProgram(void*, int, const char* const*) { return kNvrtcErrorInternal; }
MXF_NVRTC_UNAVAILABLE nvrtcGetCUBINSize(void*, unsigned long*) { return kNvrtcErrorInternal; }
MXF_NVRTC_UNAVAILABLE nvrtcGetCUBIN(void*, char*) { return kNvrtcErrorInternal; }
MXF_NVRTC_UNAVAILABLE nvrtcGetProgramLogSize(void*, unsigned long*) { return kNvrtcErrorInternal; }
MXF_NVRTC_UNAVAILABLE nvrtcGetProgramLog(void*, char*) { return kNvrtcErrorInternal; }
