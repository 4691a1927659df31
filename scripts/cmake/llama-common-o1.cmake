# Included by llama.cpp's CMake build after each project() call (CMAKE_PROJECT_INCLUDE, which
# .cargo/config.toml sets for llama-cpp-sys-2's build script). llama.cpp's `common` library is
# about half of its compile time, but mesh uses only its JSON-schema-to-grammar conversion and
# its exception-catching sampler wrappers from it, none of which is on a hot path: `common` is
# compiled at -O1, the rest of llama.cpp (ggml's kernels, the model, the tokenizer, the grammar
# sampler) at the build type's -O3 as before.
if(NOT MESH_LLAMA_COMMON_O1)
    set(MESH_LLAMA_COMMON_O1 ON)
    function(mesh_llama_common_o1)
        foreach(t llama-common llama-common-base common)
            if(TARGET ${t})
                target_compile_options(${t} PRIVATE -O1)
            endif()
        endforeach()
    endfunction()
    cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL mesh_llama_common_o1)
endif()
