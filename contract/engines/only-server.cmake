# CMake project include: build only `llama-server` (and whatever it links to).
#
# Passed as -DCMAKE_PROJECT_INCLUDE=<this file>. CMake includes it after every
# project() call, so it guards itself and only acts for the top-level project.
# It defers a call to the end of the top-level directory, walks every directory
# of the build system, and marks each target other than `llama-server` as
# EXCLUDE_FROM_ALL. Dependencies of `llama-server` are still built, because a
# target in ALL pulls in what it links to regardless of that property.

if(NOT CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)
  return()
endif()
get_property(_only_server_armed GLOBAL PROPERTY ONLY_SERVER_ARMED)
if(_only_server_armed)
  return()
endif()
set_property(GLOBAL PROPERTY ONLY_SERVER_ARMED TRUE)

set(ONLY_SERVER_KEEP "llama-server" CACHE STRING "Targets left in ALL by only-server.cmake")

function(_only_server_walk dir out_var)
  get_property(_targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  get_property(_subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(_sub IN LISTS _subdirs)
    _only_server_walk("${_sub}" _sub_targets)
    list(APPEND _targets ${_sub_targets})
  endforeach()
  set(${out_var} "${_targets}" PARENT_SCOPE)
endfunction()

function(_only_server_apply)
  _only_server_walk("${CMAKE_SOURCE_DIR}" _all)
  set(_found FALSE)
  foreach(_keep IN LISTS ONLY_SERVER_KEEP)
    if(_keep IN_LIST _all)
      set(_found TRUE)
    endif()
  endforeach()
  if(NOT _found)
    message(WARNING "only-server: none of '${ONLY_SERVER_KEEP}' exists; leaving ALL untouched")
    return()
  endif()
  set(_count 0)
  foreach(_t IN LISTS _all)
    if(_t IN_LIST ONLY_SERVER_KEEP)
      continue()
    endif()
    get_target_property(_type "${_t}" TYPE)
    if(_type STREQUAL "INTERFACE_LIBRARY")
      continue()
    endif()
    get_target_property(_excluded "${_t}" EXCLUDE_FROM_ALL)
    if(_excluded)
      continue()
    endif()
    set_property(TARGET "${_t}" PROPERTY EXCLUDE_FROM_ALL TRUE)
    math(EXPR _count "${_count} + 1")
  endforeach()
  message(STATUS "only-server: excluded ${_count} targets from ALL")
endfunction()

cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _only_server_apply)
