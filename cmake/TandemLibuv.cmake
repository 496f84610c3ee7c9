# libuv as the imported target Tandem::libuv: through pkg-config where it
# knows libuv, else by path (uv.h and libuv under CMAKE_PREFIX_PATH or the
# system's folders), for machines without pkg-config or with libuv unpacked
# into a prefix of its own. Used by the build and by TandemConfig.cmake.
if(NOT TARGET Tandem::libuv)
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(TANDEM_LIBUV QUIET IMPORTED_TARGET GLOBAL libuv)
  endif()
  add_library(Tandem::libuv INTERFACE IMPORTED GLOBAL)
  if(TARGET PkgConfig::TANDEM_LIBUV)
    target_link_libraries(Tandem::libuv INTERFACE PkgConfig::TANDEM_LIBUV)
  else()
    find_path(TANDEM_LIBUV_INCLUDE_DIR uv.h)
    find_library(TANDEM_LIBUV_LIBRARY uv)
    if(NOT TANDEM_LIBUV_INCLUDE_DIR OR NOT TANDEM_LIBUV_LIBRARY)
      message(FATAL_ERROR "Tandem needs libuv: install libuv1-dev (Debian), or name the "
                          "prefix that holds include/uv.h and libuv in CMAKE_PREFIX_PATH")
    endif()
    target_include_directories(Tandem::libuv INTERFACE ${TANDEM_LIBUV_INCLUDE_DIR})
    target_link_libraries(Tandem::libuv INTERFACE ${TANDEM_LIBUV_LIBRARY})
  endif()
endif()
